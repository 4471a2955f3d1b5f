"""The head's KV cache and its one-query-per-request attention, for drafting in the engine.

A request's head row j keeps its key and value at [slot, :, j], or with a window at [slot, :, j
mod R], R = window + the longest draft (a ring). Nothing is freed: a rejected draft's rows are
rewritten by the next chain, and never land inside a later query's window. On the CPU
drafter/head_kernel.c runs the attention; elsewhere the queries attend to the slot range the
requests span (nearly dense: rollout/core/slot_order.py) in place, in a small batched matmul.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import head_kernel


@dataclass
class HeadCache:
    k: torch.Tensor  # [slots, kv_heads, R, head_dim] (R: max_len, or a window's ring); transposed: [.., head_dim, R]
    v: torch.Tensor  # [slots, kv_heads, R, head_dim]
    cos: torch.Tensor  # [max_len, head_dim]: the head's RoPE at every position, made once
    sin_signed: torch.Tensor  # its sin, the first half negated (rotate_rolled)
    window: Optional[int] = None  # keys a query sees: positions (p - window, p]; None: all <= p
    keys_transposed: bool = False  # the layout of drafter/head_kernel.c, which then runs the attention

    @staticmethod
    def new(num_slots: int, kv_heads: int, rows: int, head_dim: int, cos: torch.Tensor, sin_signed: torch.Tensor,
            window: Optional[int]) -> HeadCache:
        """Zeroed keys and values; keys transposed for the kernel where it can run."""
        like = dict(dtype=cos.dtype, device=cos.device)
        transposed = head_kernel.supports(cos.device, cos.dtype, head_dim, rows)
        if transposed:
            rows = head_kernel.cache_rows(rows)
        k = torch.zeros((num_slots, kv_heads, head_dim, rows) if transposed else (num_slots, kv_heads, rows, head_dim),
                        **like)
        return HeadCache(k, torch.zeros(num_slots, kv_heads, rows, head_dim, **like), cos.contiguous(),
                         sin_signed.contiguous(), window, transposed)

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]  # positions the RoPE table covers

    def attend_rows(self, qkv: torch.Tensor, heads: int, rows: Rows) -> torch.Tensor:
        """qkv [N, heads + 2 kv_heads, head_dim] of the N new rows, before RoPE: every row's rotated
        key and value are written, then each request's last row attends. Returns [C, heads * head_dim]."""
        if self.keys_transposed:
            return head_kernel.write_and_attend(qkv, heads, self.k, self.v, self.cos, self.sin_signed,
                                                rows.row_slots, rows.positions, rows.last, self.window)
        rows.place(self)
        kv = self.k.shape[1]
        qk = rotate_rolled(qkv[:, :heads + kv], self.cos[rows.positions][:, None],
                           self.sin_signed[rows.positions][:, None])
        self.write(rows, qk[:, heads:], qkv[:, heads + kv:])
        return self.attend(qk[:, :heads] if rows.all_last else qk[rows.last, :heads], rows)

    def write(self, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, kv_heads, head_dim] of the N new rows (placed: Rows.place)."""
        dim = self.k.shape[-1]
        self.k.view(-1, dim).index_copy_(0, rows.write_index, k.reshape(-1, dim))
        self.v.view(-1, dim).index_copy_(0, rows.write_index, v.reshape(-1, dim))

    @property
    def rows_kept(self) -> int:
        return self.v.shape[2]  # max_len, or the ring's R

    def attend(self, q: torch.Tensor, rows: Rows) -> torch.Tensor:
        """q [C, heads, head_dim] of the rows `rows.last` (placed: Rows.place): attention over the
        keys each one sees in its slot. Returns [C, heads * head_dim]."""
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


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """rollout.kernels.ops.rotate, bit for bit, in three ops: x * cos + roll(x, half) * sin with the
    sign of the first half folded into sin ((-a) * b == a * (-b) exactly)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _attention(q, keys, values, masked) -> torch.Tensor:
    """q [R, kv, fold, D], keys / values [R, kv, K, D] (views), masked [R, K] -> [R, kv, fold, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores.masked_fill(masked[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


@dataclass
class Rows:
    """New head rows of some requests, packed: every row is written, each request's last row attends.
    `build` makes a chain's first (ragged) rows, `advance` the next position's, on the device."""

    tokens: torch.Tensor  # [N] x_{j+1}
    feats: torch.Tensor  # [N, d] h_j
    positions: torch.Tensor  # [N] j
    last: Optional[torch.Tensor]  # [C] index of each request's last row; None: every row is one
    slots: list  # [C] each request's slot (host ints)
    ends: list  # [C] each request's last position (host ints)
    row_slots: Optional[torch.Tensor] = None  # [N] each row's slot (None: a head without attention)
    req_slots: Optional[torch.Tensor] = None  # [C] each request's slot
    # The torch path's placement (Rows.place), made on first use:
    write_index: Optional[torch.Tensor] = None  # [N * kv_heads] rows of the flattened cache the new keys go to
    masked: Optional[torch.Tensor] = None  # [hi - lo, kv_len] bool: cache rows a query must not see
    grid_index: Optional[torch.Tensor] = None  # [C] slot - lo
    lo: int = 0
    hi: int = 0
    kv_len: int = 0
    dense: bool = False  # request i holds slot lo + i: the grid is the queries themselves

    @property
    def all_last(self) -> bool:
        return self.last is None

    @property
    def last_positions(self) -> torch.Tensor:
        return self.positions if self.last is None else self.positions[self.last]

    @staticmethod
    def build(slots: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]], feats: torch.Tensor,
              device, cache: Optional[HeadCache]) -> Rows:
        """Request i writes rows starts[i] .. starts[i] + len(tokens[i]) - 1 of slot slots[i];
        feats holds their features, request by request. cache None: a head without attention."""
        lens = [len(ids) for ids in tokens]
        flat = [x for ids in tokens for x in ids]
        n, c = len(flat), len(lens)
        # one host-to-device copy for all of them (split into views)
        t = torch.tensor(flat + list(slots) + list(starts) + lens, dtype=torch.int64).to(device).split([n, c, c, c])
        ends = [s + m - 1 for s, m in zip(starts, lens)]
        if n == c:  # one row per request: no gather
            positions, last = t[2], None
        else:
            lens_t = t[3]
            first = torch.cumsum(lens_t, 0) - lens_t
            positions = torch.arange(n, device=device) + torch.repeat_interleave(t[2] - first, lens_t, output_size=n)
            last = first + lens_t - 1
        rows = Rows(t[0], feats, positions, last, list(slots), ends)
        if cache is not None:
            rows.row_slots = t[1] if n == c else torch.repeat_interleave(t[1], t[3], output_size=n)
            rows.req_slots = t[1]
        return rows

    def advance(self, keep: Optional[torch.Tensor], kept: Sequence[int], tokens: torch.Tensor, feats: torch.Tensor,
                cache: Optional[HeadCache]) -> Rows:
        """The next position's rows: request kept[n] (keep: the same on the device, None: all) writes one
        row after its last, fed tokens[n] and feats[n]."""
        positions = self.last_positions + 1
        slots, ends = self.slots, self.ends
        if keep is not None:
            positions = positions[keep]
            slots, ends = [slots[i] for i in kept], [ends[i] for i in kept]
        rows = Rows(tokens, feats, positions, None, slots, [e + 1 for e in ends])
        if cache is not None:
            rows.row_slots = rows.req_slots = torch.tensor(slots, dtype=torch.int64).to(positions.device)
        return rows

    def place(self, cache: HeadCache) -> None:
        """Where the rows go in the cache and what each query sees, for the torch path."""
        if self.write_index is not None:
            return
        row_slots, req_slots = self.row_slots, self.req_slots
        heads, kept = cache.k.shape[1], cache.rows_kept
        ring = cache.window is not None
        device = row_slots.device
        cell = torch.remainder(self.positions, kept) if ring else self.positions
        self.write_index = ((row_slots * (heads * kept) + cell)[:, None]
                            + torch.arange(0, heads * kept, kept, device=device)).reshape(-1)
        self.lo, self.hi = min(self.slots), max(self.slots) + 1
        self.dense = self.slots == list(range(self.lo, self.hi))
        self.kv_len = min(kept, max(self.ends) + 1)
        q = self.last_positions
        if not self.dense:  # a grid row of no request sees row 0 only
            self.grid_index = req_slots - self.lo
            q = torch.zeros(self.hi - self.lo, dtype=torch.int64, device=device).index_copy_(0, self.grid_index, q)
        # A query at position p sees positions <= p (full), or (p - window, p] (ring: row i holds
        # position p - ((p - i) mod R)).
        keys, q = torch.arange(self.kv_len, device=device), q[:, None]
        if ring:
            back = torch.remainder(q - keys[None, :], kept)  # how far behind p the row's position is
            self.masked = (back >= cache.window) | (back > q)
        else:
            self.masked = keys[None, :] > q
