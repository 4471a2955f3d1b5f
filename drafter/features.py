"""The policy's hidden states over whole sequences, and the padded head rows built from them.

`sequence_features` returns the policy's final hidden state (after the last norm) at every
position of prompt + response, as the engine's forward does. A sequence x_0..x_{N-1} gives the
head N - 1 rows: row j = (h_j, x_{j+1}), whose teacher is the policy's distribution of x_{j+2}.
A draft chain starts at the row of the pending token, P - 1 + t for response position t.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout.core.batch import ForwardBatch
from rollout.core.model import CausalLM


@dataclass(frozen=True)
class SavedRollout:
    """One sample of a rollout, enough to recompute everything: the target's token at response
    position t is response_ids[t], drawn with Gumbel noise G(seed, t, .) at these params."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    seed: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    advantage: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)


def sequence_features(policy: CausalLM, sequences: Sequence[Sequence[int]],
                      tokens_per_forward: int = 4096) -> list[torch.Tensor]:
    """[len(seq), d] final hidden states per sequence, in the policy's dtype and device, packed up
    to tokens_per_forward per forward (a longer sequence runs in chunks through its cache slot)."""
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        bad = [t for t in seq if not 0 <= int(t) < policy.cfg.vocab_size]
        if bad:
            raise ValueError(f"sequence {i} has token {bad[0]} outside the vocabulary [0, {policy.cfg.vocab_size})")
    budget = max(1, tokens_per_forward)
    out: list = [None] * len(sequences)
    group, tokens = [], 0
    for i in sorted(range(len(sequences)), key=lambda i: len(sequences[i])):
        if group and tokens + len(sequences[i]) > budget:
            _run_group(policy, sequences, group, budget, out)
            group, tokens = [], 0
        group.append(i)
        tokens += len(sequences[i])
    if group:
        _run_group(policy, sequences, group, budget, out)
    return out


def _run_group(policy: CausalLM, sequences, group: list[int], budget: int, out: list) -> None:
    device = policy.lm_head.weight.device
    max_len = max(len(sequences[i]) for i in group)
    cache = policy.new_cache(len(group), max_len)
    parts: dict[int, list] = {i: [] for i in group}
    for start in range(0, max_len, budget):  # one pass unless a lone sequence exceeds the budget
        rows = [(slot, start, [int(t) for t in sequences[i][start:start + budget]])
                for slot, i in enumerate(group) if len(sequences[i]) > start]
        n = sum(len(r[2]) for r in rows)
        # one logit row (the last): a packed output layer (rollout/kernels/linear.py) pads a block of rows
        # from its first one, so a forward asking for no logits at all would fail there
        batch = ForwardBatch.build(rows, [n - 1], device, hidden_index=list(range(n)))
        _, hidden = policy(batch, cache)
        offset = 0
        for slot, _, ids in rows:
            # clone outside inference mode: these become ordinary tensors the trainer may use
            parts[group[slot]].append(hidden[offset:offset + len(ids)].clone())
            offset += len(ids)
    for i in group:
        out[i] = torch.cat(parts[i]) if len(parts[i]) > 1 else parts[i][0]


@dataclass
class RowBatch:
    """Head rows of B sequences, right-padded to L = the longest N - 1; the rest are [B]."""

    tokens: torch.Tensor  # [B, L] x_{j+1}
    feats: torch.Tensor  # [B, L, d] h_j
    next_feats: torch.Tensor  # [B, L, d] h_{j+1} (the teacher's)
    first: torch.Tensor  # P - 1: the first row whose draft is a response token
    rows: torch.Tensor  # N - 1 real rows
    prompt_len: torch.Tensor
    seeds: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    weight: torch.Tensor

    def valid(self, step: int) -> torch.Tensor:
        """[B, L] bool: rows whose output drafts a response token inside the sequence (rows
        P - 1 .. N - 3) and continue a chain started at such a row `step` rows before."""
        j = torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :]
        return (j >= self.first[:, None] + step) & (j < self.rows[:, None] - 1)


def row_batch(samples: Sequence[SavedRollout], features: Sequence[torch.Tensor],
              weights: Sequence[float] | None = None, device=None) -> RowBatch:
    """Pad samples (each with its [N, d] features) into head rows."""
    if len(samples) != len(features) or not samples:
        raise ValueError(f"row_batch needs one feature tensor per sample, got {len(samples)} and {len(features)}")
    device = device or features[0].device
    b, d = len(samples), features[0].shape[-1]
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples) - 1
    tokens = torch.zeros(b, max(length, 1), dtype=torch.int64)
    feats = torch.zeros(b, max(length, 1), d, dtype=features[0].dtype, device=device)
    next_feats = torch.zeros_like(feats)
    for i, (s, f) in enumerate(zip(samples, features)):
        ids = s.token_ids
        if f.shape[0] != len(ids):
            raise ValueError(f"sample {i} has {len(ids)} tokens but features for {f.shape[0]}")
        n = len(ids) - 1
        tokens[i, :n] = torch.tensor(ids[1:], dtype=torch.int64)
        feats[i, :n] = f[:-1].to(device)
        next_feats[i, :n] = f[1:].to(device)

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return RowBatch(
        tokens=tokens.to(device), feats=feats, next_feats=next_feats,
        first=col([len(s.prompt_ids) - 1 for s in samples], torch.int64),
        rows=col([len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples], torch.int64),
        prompt_len=col([len(s.prompt_ids) for s in samples], torch.int64),
        seeds=col([int(s.seed) for s in samples], torch.int64),
        temperature=col([float(s.temperature) for s in samples], torch.float32),
        top_k=col([int(s.top_k) for s in samples], torch.int64),
        top_p=col([float(s.top_p) for s in samples], torch.float32),
        weight=col(list(weights) if weights is not None else [1.0] * b, torch.float32))
