"""One forward's worth of ragged rows, and the attention layout derived from it.

A row is the run of new tokens of one request: a prompt chunk (prefill), one token (decode)
or the last token plus k drafts (verify). Linear layers see all rows packed as [N, d] so no
FLOP is spent on padding. Attention pads rows into [R, L] query grids against the cached keys
of R consecutive KV-cache slots, read in place (a view, never a gather: copying a step's keys
out of the cache cost more than attending to them).

Short rows (decode and verify) are cut, in slot order, into runs of consecutive slots; each run
is one grid whose rows attend to the longest context among them. One grid for every row would
make each pay for the longest context of the step, which in a long-tail rollout is most of the
work; one grid per row would pay a call per row. `_cut` picks the runs that minimise padded
keys plus a fixed price per grid (dynamic programming over the slot order). A slot inside a
run that has no row in it (free, or prefilling) is a padding row of that grid.
Long rows (prompt chunks) get a grid of their own: one row, no padding, and a plain causal
mask when the chunk starts the sequence.

That trade is the CPU's, where attention reads and FLOPs cost time. On a GPU a small model's step
is bound by kernel launches while padded FLOPs are nearly free: there `min_bucket` is the model
length, and every short row shares one grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

PREFILL_ROW = 16  # rows longer than this (prompt chunks) get a grid of their own
MIN_BUCKET = 64  # contexts shorter than this cost as much as this (the CPU default)
GRID_COST = 256  # the price of one more grid, in padded (query row, cached key) pairs
_LOOKBACK = 64  # the longest run the cut considers, in rows: bounds the cut's work per step


def min_bucket_for(device: torch.device, max_model_len: int) -> int:
    return MIN_BUCKET if device.type == "cpu" else max_model_len


@dataclass
class AttentionGroup:
    """Rows attended together: an [R, L] query grid against slots first_slot .. first_slot + R - 1."""

    first_slot: int
    num_rows: int  # R
    max_row_len: int  # L
    kv_len: int  # K: highest position written by these rows + 1
    query_pos: torch.Tensor  # [R, L] position of each grid query, -1 for padding
    token_index: Optional[torch.Tensor]  # [n] the batch's tokens in this grid (None: `tokens`)
    pad_index: Optional[torch.Tensor]  # [n] where each sits in the flattened [R, L] grid
    tokens: Optional[tuple[int, int]]  # one row without padding: the grid is batch tokens [a, b)
    causal: bool  # one row from position 0: a plain causal mask (query i sees keys <= i)

    def mask(self, window: Optional[int], dtype: torch.dtype, kernel_causal: bool = True,
             fold: int = 1, width: Optional[int] = None) -> Optional[torch.Tensor]:
        """[R, 1, fold * L, width] additive mask (0 or -inf) over the first `width` (default K)
        cached positions: a query at position p sees keys at positions <= p (and > p - window);
        rows repeat `fold` times (query heads folded into the query axis, head-major). Padding
        queries see key 0 only, so softmax stays finite; their outputs are dropped. None when
        `causal`, no window, no fold and kernel_causal: the attention kernel's causal mask does it."""
        if self.causal and window is None and kernel_causal and fold == 1:
            return None
        keys = torch.arange(max(self.kv_len, width or 0), device=self.query_pos.device)
        q = self.query_pos[:, :, None]
        seen = keys <= q
        if window is not None:
            seen &= keys > q - window
        seen |= (q < 0) & (keys == 0)
        mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
        if fold > 1:
            mask = mask.repeat(1, fold, 1)
        return mask[:, None]


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64, rows concatenated
    positions: torch.Tensor  # [N] int64, sequence position of each token (= its cache index)
    token_slots: torch.Tensor  # [N] int64, KV-cache slot of each token
    logit_index: torch.Tensor  # [M] int64, which of the N tokens need logits
    groups: list[AttentionGroup]
    hidden_index: Optional[torch.Tensor] = None  # [H] int64, whose hidden states to return; None: logit_index

    @staticmethod
    def build(rows: list[tuple[int, int, list[int]]], logit_index: list[int],
              device: torch.device | str, min_bucket: int = MIN_BUCKET,
              hidden_index: Optional[list[int]] = None) -> ForwardBatch:
        """rows: (slot, start position, new token ids) per row; slots distinct.
        logit_index: indices into the concatenated tokens that need logits.
        min_bucket: contexts shorter than this cost as much as this when cutting grids.
        hidden_index: indices whose final hidden states the forward returns (a draft head's
        features: prompt rows too), without paying the lm_head for them; None: logit_index."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        slots = [r[0] for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"rows of one forward must use distinct slots, got {slots}")
        tokens, positions, token_slots, offsets = [], [], [], []
        for slot, start, ids in rows:
            offsets.append(len(tokens))
            tokens.extend(ids)
            positions.extend(range(start, start + len(ids)))
            token_slots.extend([slot] * len(ids))
        ints = _Ints()
        head = [ints.add(tokens), ints.add(positions), ints.add(token_slots), ints.add(logit_index),
                ints.add(hidden_index or [])]
        short = sorted((r[0], r[1], len(r[2]), offsets[i]) for i, r in enumerate(rows) if len(r[2]) <= PREFILL_ROW)
        specs = [_prefill_spec(offsets[i], *r, ints) for i, r in enumerate(rows) if len(r[2]) > PREFILL_ROW]
        specs += [_grid_spec(run, ints) for run in _cut(short, min_bucket)]
        values = ints.tensor(device)
        token_ids, positions_t, slots_t, logits_t, hidden_t = (values[a:b] for a, b in head)
        groups = [_group(spec, values) for spec in specs]
        return ForwardBatch(token_ids, positions_t, slots_t, logits_t, groups,
                            None if hidden_index is None else hidden_t)


class _Ints:
    """Every index tensor of a batch in one host-to-device copy: spans of one int64 tensor."""

    def __init__(self):
        self.values: list[int] = []

    def add(self, xs) -> tuple[int, int]:
        a = len(self.values)
        self.values.extend(xs)
        return a, len(self.values)

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.int64).to(device)


def _prefill_spec(offset: int, slot: int, start: int, ids: list[int], ints: _Ints) -> tuple:
    n = len(ids)
    span = ints.add(range(start, start + n))
    return (slot, 1, n, start + n, span, None, None, (offset, offset + n), start == 0)


def _grid_spec(run: list[tuple[int, int, int, int]], ints: _Ints) -> tuple:
    """run: (slot, start, n, offset) of rows, by slot."""
    first, rows = run[0][0], run[-1][0] - run[0][0] + 1
    length = max(r[2] for r in run)
    query_pos = [-1] * (rows * length)
    token_index, pad_index = [], []
    for slot, start, n, offset in run:
        at = (slot - first) * length
        query_pos[at:at + n] = range(start, start + n)
        token_index.extend(range(offset, offset + n))
        pad_index.extend(range(at, at + n))
    spans = (ints.add(query_pos), ints.add(token_index), ints.add(pad_index))
    return (first, rows, length, max(r[1] + r[2] for r in run), *spans, None, False)


def _group(spec: tuple, values: torch.Tensor) -> AttentionGroup:
    first, rows, length, kv_len, pos, tok, pad, tokens, causal = spec
    return AttentionGroup(first, rows, length, kv_len, values[pos[0]:pos[1]].view(rows, length),
                          None if tok is None else values[tok[0]:tok[1]],
                          None if pad is None else values[pad[0]:pad[1]], tokens, causal)


def _cut(rows: list[tuple[int, int, int, int]], min_bucket: int) -> list[list]:
    """Split rows (sorted by slot) into runs of consecutive slots, minimising the padded work,
    slots spanned x longest context (at least min_bucket) x (1 + longest row) / 2 (reading a
    key costs about what one query's products with it do), plus GRID_COST a run. When
    min_bucket covers every context, one run: the accelerator's single grid."""
    if not rows:
        return []
    contexts = [start + n for _, start, n, _ in rows]
    if min_bucket >= max(contexts):
        return [rows]
    best = [0.0] + [float("inf")] * len(rows)  # best[j]: cost of cutting rows[:j]
    cut_at = [0] * (len(rows) + 1)
    for j in range(1, len(rows) + 1):
        longest, widest, last_slot = 0, 0, rows[j - 1][0]
        for i in range(j - 1, max(-1, j - 1 - _LOOKBACK), -1):
            longest, widest = max(longest, contexts[i]), max(widest, rows[i][2])
            padded = (last_slot - rows[i][0] + 1) * max(longest, min_bucket) * (1 + widest) / 2
            cost = best[i] + padded + GRID_COST
            if cost < best[j]:
                best[j], cut_at[j] = cost, i
    runs, j = [], len(rows)
    while j > 0:
        runs.append(rows[cut_at[j]:j])
        j = cut_at[j]
    return runs[::-1]
