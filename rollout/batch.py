"""One forward's worth of ragged rows, and the attention layout derived from it.

A row is the run of new tokens of one request: a prompt chunk (prefill), one token (decode)
or the last token plus k drafts (verify). Linear layers see all rows packed as [N, d] so no
FLOP is spent on padding; attention sees them scattered into a slot-major [S, L, ...] grid
so it can read every slot's cached keys in place, without gathering the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [N] int64, rows concatenated
    positions: torch.Tensor  # [N] int64, sequence position of each token (= its cache index)
    token_slots: torch.Tensor  # [N] int64, KV-cache slot of each token
    logit_index: torch.Tensor  # [M] int64, which of the N tokens need logits
    pad_index: torch.Tensor  # [N] int64, flat index of each token in the [S, L] attention grid
    num_slots: int  # S: attention grid rows (highest slot used + 1)
    max_row_len: int  # L
    kv_len: int  # K: keys read per slot (highest position written + 1)
    query_pos: torch.Tensor  # [S, L] int64, position of each grid query, -1 for padding

    @staticmethod
    def build(rows: list[tuple[int, int, list[int]]], logit_index: list[int],
              device: torch.device | str) -> "ForwardBatch":
        """rows: (slot, start position, new token ids) per row; slots distinct.
        logit_index: indices into the concatenated tokens that need logits."""
        if not rows:
            raise ValueError("a forward needs at least one row")
        slots = [r[0] for r in rows]
        if len(set(slots)) != len(slots):
            raise ValueError(f"rows of one forward must use distinct slots, got {slots}")
        tokens, positions, token_slots, pad = [], [], [], []
        num_slots, max_len = max(slots) + 1, max(len(r[2]) for r in rows)
        query_pos = [[-1] * max_len for _ in range(num_slots)]
        for slot, start, ids in rows:
            n = len(ids)
            tokens.extend(ids)
            positions.extend(range(start, start + n))
            token_slots.extend([slot] * n)
            pad.extend(range(slot * max_len, slot * max_len + n))
            query_pos[slot][:n] = range(start, start + n)
        kv_len = max(r[1] + len(r[2]) for r in rows)

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=device)

        return ForwardBatch(t(tokens), t(positions), t(token_slots), t(logit_index), t(pad),
                            num_slots, max_len, kv_len, t(query_pos))

    def attention_mask(self, window: Optional[int] = None) -> torch.Tensor:
        """[S, 1, L, K] bool: a query at position p sees keys at positions <= p (and > p - window).
        Padding queries see key 0 only, so softmax stays finite; their outputs are dropped."""
        keys = torch.arange(self.kv_len, device=self.query_pos.device)
        q = self.query_pos[:, :, None]
        mask = keys <= q
        if window is not None:
            mask &= keys > q - window
        mask |= (q < 0) & (keys == 0)
        return mask[:, None]
