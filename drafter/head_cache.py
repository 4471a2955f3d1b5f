"""The head's KV cache and its one-query-per-request attention, for drafting in the engine.

One slot per engine slot: a request's head row j keeps its key and value at [slot, :, j]. As in
the engine's own cache nothing is freed or copied: a rejected draft's rows are simply rewritten by
the next chain, and attention never reads a key beyond the row it attends from.

Each draft position attends from one row per request (`Rows.last`), so attention is a small
batched matmul over the cache's slots read in place: queries are scattered into a grid over the
slot range the requests span (requests hold the engine's lowest free slots, so the range is
nearly dense), with no gather of keys and no fused kernel whose set-up dominates at these sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class HeadCache:
    k: torch.Tensor  # [slots, kv_heads, max_len, head_dim]
    v: torch.Tensor
    cos: torch.Tensor  # [max_len, head_dim]: the head's RoPE at every position, made once
    sin: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] of N rows at (slots[i], positions[i])."""
        _, heads, length, dim = self.k.shape
        h = torch.arange(heads, device=slots.device)
        index = ((slots[:, None] * heads + h) * length + positions[:, None]).reshape(-1)
        self.k.view(-1, dim).index_copy_(0, index, k.reshape(-1, dim))
        self.v.view(-1, dim).index_copy_(0, index, v.reshape(-1, dim))

    def attend(self, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """q [C, heads, head_dim] of the rows `rows.last`: attention over keys 0..position of
        each one's slot. Returns [C, heads * head_dim]."""
        c, num_heads, dim = q.shape
        kv_heads = self.k.shape[1]
        fold = num_heads // kv_heads
        lo, hi, width = rows.lo, rows.hi, rows.kv_len
        keys, values = self.k[lo:hi, :, :width], self.v[lo:hi, :, :width]  # views
        grid = q.new_zeros(hi - lo, kv_heads, fold, dim)
        grid[rows.grid_index] = q.view(c, kv_heads, fold, dim)
        scores = torch.matmul(grid, keys.transpose(-1, -2)) * (1.0 / math.sqrt(dim))  # [R, kv, fold, K]
        scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        scores = scores.masked_fill(rows.masked[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [R, kv, fold, D]
        return out[rows.grid_index].reshape(c, num_heads * dim)


@dataclass
class Rows:
    """New head rows of some requests, packed: every row is written, each request's last row is
    attended from. lo, hi: the slot range of the requests; kv_len: keys to read per slot."""

    tokens: torch.Tensor  # [N] x_{j+1}
    feats: torch.Tensor  # [N, d] h_j
    slots: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] j
    last: torch.Tensor  # [C] index of each request's last row
    grid_index: torch.Tensor  # [C] its slot - lo
    masked: torch.Tensor  # [hi - lo, kv_len] bool: keys a grid row must not see
    lo: int
    hi: int
    kv_len: int

    @staticmethod
    def build(slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]], feats: torch.Tensor,
              device) -> Rows:
        """Request i writes rows starts[i] .. starts[i] + len(tokens[i]) - 1 of slot slots[i];
        feats holds their features, request by request."""
        flat_tokens, flat_slots, flat_pos, last = [], [], [], []
        for slot, start, ids in zip(slots, starts, tokens):
            flat_tokens.extend(ids)
            flat_slots.extend([slot] * len(ids))
            flat_pos.extend(range(start, start + len(ids)))
            last.append(len(flat_tokens) - 1)
        ends = [s + len(ids) - 1 for s, ids in zip(starts, tokens)]
        lo, hi, width = min(slots), max(slots) + 1, max(ends) + 1
        qpos = [-1] * (hi - lo)
        for slot, end in zip(slots, ends):
            qpos[slot - lo] = end
        keys = torch.arange(width, device=device)
        q = torch.tensor(qpos, dtype=torch.int64, device=device)[:, None]
        masked = (keys > q) & ~((q < 0) & (keys == 0))  # a grid row of no request sees key 0: softmax stays finite

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return Rows(t(flat_tokens), feats, t(flat_slots), t(flat_pos), t(last), t([s - lo for s in slots]), masked,
                    lo, hi, width)
