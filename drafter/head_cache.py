"""The head's KV cache and its one-query-per-request attention, for drafting in the engine.

One slot per engine slot: a request's head row j keeps its key and value at [slot, :, j], or for
a head with a window at [slot, :, j mod R] with R = window + the longest draft (a ring: a query
reads only the window, so the cache is R rows long whatever the context). As in the engine's own
cache nothing is freed or copied: a rejected draft's rows are simply rewritten by the next chain,
and every row a query reads was written before it for the same request (rows are written in
order from 0). A draft row lies at most one draft beyond the rows made from the policy's
features, so with R rows it never lands on a row still inside a later query's window. Keys carry
their rotation, so the order of a ring's rows does not matter to attention.

Each draft position attends from one row per request (`Rows.last`): the queries are scattered into
a grid over the slot range the requests span (they hold the engine's lowest free slots, so the
range is nearly dense) and attend to the slots in place: a small batched matmul, with no gather
and no fused kernel whose set-up dominates at these sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class HeadCache:
    k: torch.Tensor  # [slots, kv_heads, max_len (or window), head_dim]
    v: torch.Tensor
    cos: torch.Tensor  # [max_len, head_dim]: the head's RoPE at every position, made once
    sin_signed: torch.Tensor  # its sin, the first half negated (drafter.head.rotate_rolled)
    window: Optional[int] = None  # keys a query sees: positions (p - window, p]; None: all <= p

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]  # positions the RoPE table covers

    def write(self, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] of the N new rows."""
        dim = self.k.shape[-1]
        self.k.view(-1, dim).index_copy_(0, rows.write_index, k.reshape(-1, dim))
        self.v.view(-1, dim).index_copy_(0, rows.write_index, v.reshape(-1, dim))

    @property
    def rows_kept(self) -> int:
        return self.k.shape[2]  # max_len, or the ring's R

    def attend(self, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """q [C, heads, head_dim] of the rows `rows.last`: attention over the keys each one sees
        in its slot. Returns [C, heads * head_dim]."""
        c, num_heads, dim = q.shape
        kv_heads = self.k.shape[1]
        lo, hi, width = rows.lo, rows.hi, rows.kv_len
        q = q.view(c, kv_heads, num_heads // kv_heads, dim)
        dense = rows.dense
        if not dense:
            grid = q.new_zeros(hi - lo, *q.shape[1:])
            grid[rows.grid_index] = q
            q = grid
        out = _attention(q, self.k[lo:hi, :, :width], self.v[lo:hi, :, :width], rows.masked)
        return (out if dense else out[rows.grid_index]).reshape(c, num_heads * dim)


def _attention(q, keys, values, masked) -> torch.Tensor:
    """q [R, kv, fold, D], keys / values [R, kv, K, D] (views), masked [R, K] -> [R, kv, fold, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


@dataclass
class Rows:
    """New head rows of some requests, packed: every row is written, each request's last row is
    attended from. lo, hi: the slot range of the requests; kv_len: cache rows read per slot."""

    tokens: torch.Tensor  # [N] x_{j+1}
    feats: torch.Tensor  # [N, d] h_j
    slots: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] j
    last: torch.Tensor  # [C] index of each request's last row
    write_index: torch.Tensor  # [N * kv_heads] rows of the flattened cache the new keys go to
    masked: Optional[torch.Tensor]  # [hi - lo, kv_len] bool: cache rows a query must not see
    grid_index: Optional[torch.Tensor]  # [C] slot - lo
    lo: int
    hi: int
    kv_len: int

    dense: bool = False  # request i holds slot lo + i: the grid is the queries themselves

    @property
    def all_last(self) -> bool:
        return self.last.shape[0] == self.tokens.shape[0]

    @staticmethod
    def build(slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]], feats: torch.Tensor,
              device, cache: Optional[HeadCache]) -> Rows:
        """Request i writes rows starts[i] .. starts[i] + len(tokens[i]) - 1 of slot slots[i];
        feats holds their features, request by request. cache None: a head without attention."""
        flat_tokens, flat_slots, flat_pos, last, write = [], [], [], [], []
        heads, kept = (cache.k.shape[1], cache.rows_kept) if cache is not None else (0, 1)
        ring = cache is not None and cache.window is not None
        for slot, start, ids in zip(slots, starts, tokens):
            flat_tokens.extend(ids)
            flat_slots.extend([slot] * len(ids))
            flat_pos.extend(range(start, start + len(ids)))
            last.append(len(flat_tokens) - 1)
            base = slot * heads * kept
            write.extend(base + h * kept + (p % kept if ring else p)
                         for p in range(start, start + len(ids)) for h in range(heads))

        ends = [s + len(ids) - 1 for s, ids in zip(starts, tokens)]
        lo, hi = min(slots), max(slots) + 1
        qpos = [0] * (hi - lo)  # a grid row of no request sees row 0 only
        for slot, end in zip(slots, ends):
            qpos[slot - lo] = end
        parts = (flat_tokens, flat_slots, flat_pos, last, write, qpos, [s - lo for s in slots])
        # one host-to-device copy for all of them (split into views)
        t = torch.tensor([x for part in parts for x in part], dtype=torch.int64).to(device).split(
            [len(part) for part in parts])
        rows = Rows(t[0], feats, t[1], t[2], t[3], t[4], None, t[6], lo, hi, 0,
                    dense=list(slots) == list(range(lo, hi)))
        if cache is None:
            return rows
        # A query at position p sees positions <= p (full), or (p - window, p] (ring: row i holds
        # position p - ((p - i) mod R)).
        rows.kv_len = min(kept, max(ends) + 1)
        keys, q = torch.arange(rows.kv_len, device=device), t[5][:, None]
        if ring:
            back = torch.remainder(q - keys[None, :], kept)  # how far behind p the row's position is
            rows.masked = (back >= cache.window) | (back > q)
        else:
            rows.masked = keys[None, :] > q
        return rows
