"""Simulated acceptance: the exact acceptance of a head's coupled drafts on a saved rollout, where
the target's token at every position is the saved one. Chains start at every response position,
all at once through `head.unroll`; their runs are what the engine would see.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout.core import sampling
from rollout.core.model import CausalLM

from .features import RowBatch, SavedRollout, row_batch, sequence_features
from .vocab import expand

SAMPLE_ROWS = 1024  # rows coupled_drafts samples at a time


@torch.no_grad()
def chain_runs(head, policy: CausalLM, rollouts: Sequence[SavedRollout], max_k: int = 8,
               features: Optional[Sequence[torch.Tensor]] = None, batch_tokens: int = 2048) -> list[list[tuple]]:
    """Per rollout, per chain start t = 0 .. R - 2 (the pending token's response position):
    (accepted run, chain length) of a max_k-token chain; the length is min(max_k, R - 1 - t)."""
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    if features is None:
        features = sequence_features(policy, [r.token_ids for r in rollouts])
    out: list = [None] * len(rollouts)
    for idx in _batches(rollouts, batch_tokens):
        rb = row_batch([rollouts[i] for i in idx], [features[i] for i in idx])
        runs, lengths = _runs(head, policy, rb, max_k)
        for b, i in enumerate(idx):
            first, last = int(rb.first[b]), int(rb.rows[b]) - 1  # starts: rows P-1 .. N-3
            out[i] = list(zip(runs[b, first:last].tolist(), lengths[b, first:last].tolist()))
    return out


def _batches(rollouts: Sequence[SavedRollout], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so padding stays small, each group within batch_tokens padded."""
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].token_ids))
    groups, cur = [], []
    for i in order:
        if cur and len(rollouts[i].token_ids) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    return groups + ([cur] if cur else [])


def _runs(head, policy: CausalLM, rb: RowBatch, max_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] accepted run and chain length of the chain starting at each row."""
    drafts: dict[int, torch.Tensor] = {}
    ids = getattr(head, "draft_vocab", None)  # (any object with unroll may stand in for a head)

    def pick(s: int, logits: torch.Tensor) -> torch.Tensor:
        if s not in drafts:
            drafts[s] = coupled_drafts(rb, s, logits, ids, policy.cfg.vocab_size)
        return drafts[s]

    steps = head.unroll(policy, rb.tokens, rb.feats, max_k, pick)
    for s, (_, logits) in enumerate(steps):  # the last step's drafts (unroll feeds on all but it)
        pick(s, logits)
    target = torch.cat([rb.tokens[:, 1:], torch.zeros_like(rb.tokens[:, :1])], dim=1)  # row j: x_{j+2}
    accepted, alive = [], []
    for s in range(max_k):
        valid = rb.valid(s)
        hit = (drafts[s] == target) & valid
        accepted.append(_shift_left(hit, s))  # [b, p]: step s of the chain started at row p
        alive.append(_shift_left(valid, s))
    runs = torch.stack(accepted).long().cumprod(0).sum(0)
    lengths = torch.stack(alive).long().sum(0)
    return runs, lengths


def coupled_drafts(rb: RowBatch, step: int, logits: torch.Tensor, vocab_ids: Optional[torch.Tensor] = None,
                   vocab_size: Optional[int] = None) -> torch.Tensor:
    """[B, L] the coupled draft of each row valid at this step (0 elsewhere), with the sample's own noise;
    vocab_ids: the columns' ids of a head with a draft vocabulary."""
    b_all, j_all = rb.valid(step).nonzero(as_tuple=True)
    out = torch.zeros(rb.tokens.shape, dtype=torch.int64, device=logits.device)
    # in blocks of rows: a draft vocabulary's rows spread over the whole vocabulary would
    # otherwise hold every valid row at full width at once
    for lo in range(0, b_all.numel(), SAMPLE_ROWS):
        b_idx, j_idx = b_all[lo:lo + SAMPLE_ROWS], j_all[lo:lo + SAMPLE_ROWS]
        rows = logits[b_idx, j_idx].detach()
        if vocab_ids is not None:
            rows = expand(rows, vocab_ids, vocab_size)
        tok, _ = sampling.sample(rows, rb.seeds[b_idx], j_idx + 2 - rb.prompt_len[b_idx],
                                 rb.temperature[b_idx], rb.top_k[b_idx], rb.top_p[b_idx])
        out[b_idx, j_idx] = tok
    return out


def _shift_left(t: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t
    return torch.cat([t[:, n:], torch.zeros_like(t[:, :n])], dim=1)


def summarize(runs: Sequence[Sequence[tuple[int, int]]], max_k: int = 8) -> dict:
    """Acceptance figures of chains of k = 1..max_k tokens: per_token (accepted / compared),
    accepted_fraction, mean_run, tokens_per_forward; by_position[i]: given positions 1..i-1 landed."""
    flat = [rn for r in runs for rn in r]
    if not flat:
        raise ValueError("no chain starts: every response is shorter than 2 tokens")
    by_k = {}
    for k in range(1, max_k + 1):
        acc = sum(min(r, k) for r, _ in flat)
        proposed = sum(min(n, k) for _, n in flat)
        compared = acc + sum(1 for r, n in flat if min(r, k) < min(n, k))
        tokens = sum(len(r) + 1 for r in runs)
        forwards = sum(_walk(r, k) for r in runs)
        by_k[k] = {"per_token": acc / compared, "accepted_fraction": acc / proposed,
                   "mean_run": acc / len(flat), "tokens_per_forward": tokens / max(1, forwards)}
    by_position = {}
    for i in range(1, max_k + 1):
        reached = sum(1 for r, n in flat if r >= i - 1 and n >= i)
        by_position[i] = sum(1 for r, n in flat if r >= i and n >= i) / reached if reached else float("nan")
    return {"chain_starts": len(flat), "first_token_acceptance": by_k[1]["per_token"],
            "per_token_acceptance": by_k[max_k]["per_token"], "by_k": by_k, "by_position": by_position}


def _walk(runs: Sequence[tuple[int, int]], k: int) -> int:
    """Verify forwards of one response of len(runs) + 1 tokens when each drafts k tokens."""
    t, forwards = 0, 0
    while t < len(runs):  # y_0 comes from the prefill; a verify at t (t <= R - 2) emits run + 1
        forwards += 1
        t += min(runs[t][0], k) + 1
    return forwards


def simulated_acceptance(head, policy: CausalLM, rollouts: Sequence[SavedRollout], max_k: int = 8,
                         features: Optional[Sequence[torch.Tensor]] = None) -> dict:
    """summarize(chain_runs(...)): the offline acceptance of this head on these rollouts."""
    return summarize(chain_runs(head, policy, rollouts, max_k, features), max_k)
