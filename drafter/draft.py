"""Coupled draft chains for many requests at once, through the head's KV cache.

One batched head forward writes each request's new rows (target features up to the pending
token) and drafts the first token, then one batched forward per further position. Every draft
token is rollout.core.sampling's coupled sample on the head's logits with the request's seed, position
and params, so a head whose distribution matches the policy's lands nearly always.

Rollback is free: a row's key lives at [slot, position], and the next call overwrites from the
first row whose input was a draft; attention never reads past the row being written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from rollout.core.model import CausalLM

from .coupled import CoupledSampler
from .head import DraftHead
from .head_cache import HeadCache, Rows


@dataclass(frozen=True)
class Chain:
    """One request's draft request. slot: in the head's cache; start: its first row to write.
    tokens: x_{j+1} of rows start..p, the last the pending token; feats [len(tokens), d]: their h_j.
    position: the response position of the first draft token. k: draft tokens wanted; a chain
    ends at one of its stop tokens."""

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
    stop: Sequence[int] = ()


@dataclass
class ChainDraft:
    tokens: list[int]
    margins: list[float]  # best minus second-best perturbed head score, per draft token


def draft_chains(head: DraftHead, policy: CausalLM, cache: Optional[HeadCache], chains: Sequence[Chain],
                 margins: bool = False, keep: Optional[Callable[[int, ChainDraft], bool]] = None,
                 proceed: Optional[Callable[[list[int]], bool]] = None) -> list[ChainDraft]:
    """Draft chains[i].k coupled tokens for every chain: 1 + (max k - 1) batched head forwards.
    A chain ends early at a stop token or when keep(i, its draft so far) is False; all end when
    proceed(the chains that would go on) is False. Later rows are made on the device (Rows.advance)."""
    if not chains:
        return []
    _check(chains, cache)
    device = head.fc.weight.device
    drafts = [ChainDraft([], []) for _ in chains]
    feats = torch.cat([c.feats for c in chains]).to(device)
    rows = Rows.build([c.slot for c in chains], [c.start for c in chains], [c.tokens for c in chains], feats, device,
                      cache)
    packed = head.packed()  # (once: no weight changes within the call)
    out, logits = head.forward_rows(policy, cache, rows, packed)
    sampler = CoupledSampler(chains, device, head.draft_vocab, head.vocab_size)
    live, index = list(range(len(chains))), None
    for s in range(max(c.k for c in chains)):
        toks, picked, gaps = sampler.draft(logits, live, s, margins, index)
        for i, t, g in zip(live, picked, gaps):
            drafts[i].tokens.append(t)
            drafts[i].margins.append(g)
        going = [n for n, i in enumerate(live) if chains[i].k > s + 1 and drafts[i].tokens[-1] not in chains[i].stop
                 and (keep is None or keep(i, drafts[i]))]
        if not going or (proceed is not None and not proceed([live[n] for n in going])):
            break
        step = None
        if len(going) < len(live):
            live = [live[n] for n in going]
            step = torch.tensor(going).to(device)
            index = torch.tensor(live).to(device)
            toks, out = toks[step], out[step]
        rows = rows.advance(step, going, toks, out, cache)
        out, logits = head.forward_rows(policy, cache, rows, packed)
    return drafts


def _check(chains: Sequence[Chain], cache: Optional[HeadCache]) -> None:
    slots = [c.slot for c in chains]
    if len(set(slots)) != len(slots):
        raise ValueError(f"chains of one call must use distinct slots, got {slots}")
    if cache is not None:  # (read once: this runs for every chain of every step)
        max_len, num_slots = cache.max_len, cache.num_slots
        ring = cache.window is not None and cache.rows_kept < max_len
        max_k = cache.rows_kept - cache.window if ring else max_len
    for c in chains:
        n = len(c.tokens)
        if n < 1 or c.feats.shape[0] != n or c.k < 1:
            raise ValueError(f"chain of slot {c.slot}: needs >= 1 token, one feature row per token and k >= 1")
        if cache is not None and (c.start < 0 or c.start + n + c.k - 1 > max_len or not 0 <= c.slot < num_slots
                                  or c.k > max_k):
            raise ValueError(f"chain of slot {c.slot}: rows {c.start}..{c.start + n + c.k - 2} do not fit "
                             f"the head's cache ({num_slots} slots of {max_len} rows)")
