"""One forward's ragged rows (prompt chunks, decodes, verify rows), packed as [N, d] for the linear
layers, and the grids torch's attention pads them into: grouped by context bucket (powers of two)
and by long prompt chunks, verify rows apart where they would pad many decodes. That trade is the
CPU's; on a GPU `min_bucket` is the model length and decodes and drafts share one grid.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

PREFILL_ROW = 16  # rows longer than this (prompt chunks) are not padded together with decodes
SPLIT_PADDING = 32  # padded decode queries from which verify rows get their own grid (on the CPU)
MIN_BUCKET = 64  # context lengths up to this share one group (the CPU default)


def min_bucket_for(device: torch.device, max_model_len: int) -> int:
    return MIN_BUCKET if device.type == "cpu" else max_model_len


@dataclass
class AttentionGroup:
    """Rows attended together: queries in an [R, L] grid against K cached keys per slot."""

    slots: torch.Tensor  # [R] KV-cache slot of each grid row
    first_slot: Optional[int]  # set when slots are first_slot, first_slot + 1, ...: read the cache in place
    token_index: torch.Tensor  # [n] which of the batch's N tokens belong to this group
    pad_index: torch.Tensor  # [n] where each of them sits in the flattened [R, L] grid
    query_pos: torch.Tensor  # [R, L] position of each grid query, -1 for padding
    num_rows: int  # R
    max_row_len: int  # L
    kv_len: int  # K: highest position written by these rows + 1

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[R, 1, L, K] bool: a query at position p sees keys at positions <= p (and > p - window).
        Padding queries see key 0 only, so softmax stays finite; their outputs are dropped."""
        keys = torch.arange(self.kv_len, device=self.query_pos.device)
        q = self.query_pos[:, :, None]
        mask = keys <= q
        if window is not None:
            mask &= keys > q - window
        mask |= (q < 0) & (keys == 0)
        return mask[:, None]


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64, rows concatenated
    positions: torch.Tensor  # [N] int64, sequence position of each token (= its cache index)
    token_slots: torch.Tensor  # [N] int64, KV-cache slot of each token
    logit_index: torch.Tensor  # [M] int64, which of the N tokens need logits
    rows: list  # (slot, start position, new token ids) per row, as given to `build`
    min_bucket: int
    hidden_index: Optional[torch.Tensor] = None  # [H] int64, whose hidden states to return; None: logit_index

    @functools.cached_property
    def groups(self) -> list[AttentionGroup]:
        """The attention grids, built the first time torch's attention asks for them (the CPU
        kernel, rollout/kernels/attention_kernel.py, needs none)."""
        device = self.token_ids.device
        rows = self.rows
        offsets = [0] * len(rows)
        for i in range(1, len(rows)):
            offsets[i] = offsets[i - 1] + len(rows[i - 1][2])
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, (_, start, ids) in enumerate(rows):
            key = (bucket(start + len(ids), self.min_bucket), 2 if len(ids) > PREFILL_ROW else 0)
            buckets.setdefault(key, []).append(i)
        if device.type == "cpu":
            _split_verify_rows(buckets, rows)
        return [_group([(offsets[i], *rows[i]) for i in sorted(members, key=lambda i: rows[i][0])], device)
                for _, members in sorted(buckets.items())]

    @staticmethod
    def build(rows: list[tuple[int, int, list[int]]], logit_index: list[int],
              device: torch.device | str, min_bucket: int = MIN_BUCKET,
              hidden_index: Optional[list[int]] = None) -> ForwardBatch:
        """rows: (slot, start position, new token ids) per row, slots distinct; logit_index, hidden_index:
        the tokens that need logits, and final hidden states (None: the logit rows)."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        slots = [r[0] for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"rows of one forward must use distinct slots, got {slots}")
        tokens, positions, token_slots = [], [], []
        for slot, start, ids in rows:
            tokens.extend(ids)
            positions.extend(range(start, start + len(ids)))
            token_slots.extend([slot] * len(ids))

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return ForwardBatch(t(tokens), t(positions), t(token_slots), t(logit_index), list(rows), min_bucket,
                            None if hidden_index is None else t(hidden_index))


def _split_verify_rows(buckets: dict, rows: list) -> None:
    """Give a bucket's verify rows (kind 1) a grid apart from its decodes where sharing would pad
    SPLIT_PADDING or more decode queries."""
    for (bucket, kind), members in list(buckets.items()):
        if kind != 0:
            continue
        verify = [i for i in members if len(rows[i][2]) > 1]
        decodes = len(members) - len(verify)
        if verify and decodes * (max(len(rows[i][2]) for i in verify) - 1) >= SPLIT_PADDING:
            buckets[bucket, 0] = [i for i in members if len(rows[i][2]) == 1]
            buckets[bucket, 1] = verify


def bucket(kv_len: int, min_bucket: int = MIN_BUCKET) -> int:
    """The context bucket of a row reaching kv_len: the power of two above it, at least min_bucket."""
    return max(min_bucket, 1 << (kv_len - 1).bit_length())


def _group(rows: list[tuple[int, int, int, list[int]]], device) -> AttentionGroup:
    """rows: (offset of the row's first token, slot, start, ids), sorted by slot. Slots spanning at most
    twice the rows are read in place (a missing slot is a padding row); sparser ones are gathered."""
    length = max(len(r[3]) for r in rows)
    slots = [r[1] for r in rows]
    span = slots[-1] - slots[0] + 1
    in_place = span <= 2 * len(rows)
    grid_rows = [s - slots[0] for s in slots] if in_place else list(range(len(rows)))
    num_rows = span if in_place else len(rows)
    token_index, pad_index = [], []
    query_pos = [[-1] * length for _ in range(num_rows)]
    for j, (offset, _, start, ids) in zip(grid_rows, rows):
        n = len(ids)
        token_index.extend(range(offset, offset + n))
        pad_index.extend(range(j * length, j * length + n))
        query_pos[j][:n] = range(start, start + n)

    def t(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    read = list(range(slots[0], slots[0] + span)) if in_place else slots
    return AttentionGroup(t(read), slots[0] if in_place else None, t(token_index), t(pad_index),
                          t(query_pos), num_rows, length, max(r[2] + len(r[3]) for r in rows))
