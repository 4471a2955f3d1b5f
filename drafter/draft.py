"""Coupled draft chains for many requests at once, through the head's KV cache.

What the engine's "drafter" proposer runs each step, for every request that wants a draft:
one batched head forward that writes the request's new rows (the target features it has not seen
yet, ending at the pending token) and drafts the first token, then one batched forward per
further draft position, each row fed its own previous draft token and output feature. Every
draft token is rollout.sampling's coupled sample on the head's logits with the request's seed,
response position and params, so a head whose distribution matches the policy's lands nearly
always (Gumbel coupling), whatever the temperature.

Rollback is free, as in the engine's cache: a row's key lives at [slot, position]; the next call
for the request starts at its first row whose input was a draft (or was never written) and
overwrites from there, and attention never reads past the row being written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rollout import sampling
from rollout.batch import MIN_BUCKET, ForwardBatch
from rollout.kv_cache import KVCache
from rollout.model import CausalLM

from .head import DraftHead


@dataclass(frozen=True)
class Chain:
    """One request's draft request.

    slot: its slot in the head's cache. start: its first row to write (rows below hold keys made
    from target features of this same context). tokens: x_{j+1} of rows start..p, the last being
    the pending token; feats [len(tokens), d]: h_j of those rows, from the policy's forwards.
    position: the response position of the first draft token (the pending token's + 1).
    k: draft tokens wanted."""

    slot: int
    start: int
    tokens: Sequence[int]
    feats: torch.Tensor
    seed: int
    position: int
    k: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class ChainDraft:
    tokens: list[int]
    margins: list[float]  # best minus second-best perturbed head score, per draft token


def draft_chains(head: DraftHead, policy: CausalLM, cache: Optional[KVCache], chains: Sequence[Chain],
                 min_bucket: int = MIN_BUCKET, margins: bool = False) -> list[ChainDraft]:
    """Draft chains[i].k coupled tokens for every chain: 1 + (max k - 1) batched head forwards."""
    if not chains:
        return []
    for c in chains:
        if len(c.tokens) < 1 or c.feats.shape[0] != len(c.tokens) or c.k < 1:
            raise ValueError(f"chain of slot {c.slot}: needs >= 1 token, one feature row per token and k >= 1")
        if cache is not None and (c.start < 0 or c.start + len(c.tokens) + c.k - 1 > cache.max_len
                                  or not 0 <= c.slot < cache.num_slots):
            raise ValueError(f"chain of slot {c.slot}: rows {c.start}..{c.start + len(c.tokens) + c.k - 2} do not fit "
                             f"the head's cache ({cache.num_slots} slots of {cache.max_len} rows)")
    device = head.fc.weight.device
    drafts = [ChainDraft([], []) for _ in chains]
    rows = [(c.slot, c.start, [int(t) for t in c.tokens]) for c in chains]
    ends = torch.tensor([len(r[2]) for r in rows]).cumsum(0) - 1
    feats = torch.cat([c.feats for c in chains]).to(device)
    live = list(range(len(chains)))
    params = _chain_params(chains, device)
    out, logits = head.forward_cached(policy, ForwardBatch.build(rows, ends.tolist(), device, min_bucket),
                                      cache, feats)
    for s in range(max(c.k for c in chains)):
        toks, gaps = _sample(logits, params, s, margins)
        for i, t, g in zip(live, toks, gaps):
            drafts[i].tokens.append(t)
            drafts[i].margins.append(g)
        keep = [n for n, i in enumerate(live) if chains[i].k > s + 1]
        if not keep:
            break
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            params = tuple(p[index] for p in params)
        live = [live[n] for n in keep]
        rows = [(chains[i].slot, chains[i].start + len(chains[i].tokens) + s, [drafts[i].tokens[-1]]) for i in live]
        out, logits = head.forward_cached(policy, ForwardBatch.build(rows, list(range(len(live))), device, min_bucket),
                                          cache, out[keep])
    return drafts


def _chain_params(chains: Sequence[Chain], device) -> tuple[torch.Tensor, ...]:
    """[C] seeds, first draft positions, temperature, top_k, top_p: made once per call."""
    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return (col([c.seed for c in chains], torch.int64), col([c.position for c in chains], torch.int64),
            col([float(c.temperature) for c in chains], torch.float32),
            col([int(c.top_k) for c in chains], torch.int64), col([float(c.top_p) for c in chains], torch.float32))


def _sample(logits: torch.Tensor, params: tuple[torch.Tensor, ...], step: int, margins: bool):
    """The coupled draft token of each live chain at its step-th draft position (and the margin)."""
    seeds, first, temperature, top_k, top_p = params
    positions = first + step
    tokens, _ = sampling.sample(logits, seeds, positions, temperature, top_k, top_p)
    if not margins:
        return tokens.tolist(), [float("nan")] * len(seeds)
    z = sampling.process_logits(logits, temperature, top_k, top_p)
    scores = torch.where((temperature > 0)[:, None], z + sampling.gumbel_noise(seeds, positions, z.shape[-1]), z)
    top2 = scores.topk(min(2, scores.shape[-1]), dim=-1).values
    gap = top2[:, 0] - top2[:, -1] if top2.shape[-1] > 1 else torch.full_like(top2[:, 0], float("inf"))
    return tokens.tolist(), gap.tolist()
