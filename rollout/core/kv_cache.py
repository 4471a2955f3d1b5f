"""A static, slot-based KV cache: one slot per running request, preallocated once. A request's
keys and values for position p live at [slot, :, p] (keys at [slot, :, :, p] where transposed for
the CPU attention kernel). Nothing is freed: a rejected draft is rolled back by lowering the
request's cached length, stale entries beyond it are masked until overwritten. A request may move
to another slot between steps (rollout/core/slot_order.py).
"""
from __future__ import annotations

import torch

from ..kernels import attention_kernel

KEY_ROW_PAD_BYTES = 64  # one cache line after each transposed key row


class KVCache:
    """keys_transposed: keys held [slot, head, head_dim, position] for the CPU kernel, each row padded by
    a cache line (self.k holds views without it): rows 4 KiB apart would share one cache set."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, keys_transposed: bool = False):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        if keys_transposed:
            pad = KEY_ROW_PAD_BYTES // torch.empty((), dtype=dtype).element_size()
            rows = (num_slots, num_kv_heads, head_dim, max_len + pad)
            self.k = [torch.zeros(rows, dtype=dtype, device=device)[..., :max_len] for _ in range(num_layers)]
        else:
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len, self.keys_transposed = num_slots, max_len, keys_transposed

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for N tokens at (slots[i], positions[i])."""
        if self.keys_transposed:  # (the CPU kernel's layout: its library writes both)
            attention_kernel.write_keys(self.k[layer], slots, positions, k)
            attention_kernel.write_values(self.v[layer], slots, positions, v)
        else:
            self.k[layer][slots, :, positions] = k
            self.v[layer][slots, :, positions] = v

    def prefixes(self, length: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, views of positions [0, length) of every slot: (keys, values)."""
        keys = [t[..., :length] if self.keys_transposed else t[:, :, :length] for t in self.k]
        return list(zip(keys, [t[:, :, :length] for t in self.v]))

    def move(self, src: list[int], dst: list[int], length: int) -> None:
        """Positions [0, length) of slots src[i] into slots dst[i], every layer. All sources are
        read before any destination is written, so the moves may swap slots among themselves."""
        device = self.k[0].device
        src_t, dst_t = (torch.tensor(x, dtype=torch.int64, device=device) for x in (src, dst))
        for layer in self.prefixes(length):
            for t in layer:
                move_slots(t, src_t, dst_t)

    def read(self, layer: int, slots: torch.Tensor, first_slot: int | None,
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, kv_heads, length, head_dim] of these slots for torch's attention: a
        view when the slots are a contiguous range, else a gather of the `length` positions."""
        if self.keys_transposed:
            raise RuntimeError("KVCache.read: this cache holds its keys transposed for the CPU attention kernel")
        if first_slot is not None:
            end = first_slot + slots.shape[0]
            return self.k[layer][first_slot:end, :, :length], self.v[layer][first_slot:end, :, :length]
        # index_select copies the rows faster than indexing with a tensor does (docs/results.md)
        return (self.k[layer][:, :, :length].index_select(0, slots),
                self.v[layer][:, :, :length].index_select(0, slots))


def move_slots(t: torch.Tensor, src, dst) -> None:
    """t[dst[i]] = t[src[i]] along the first dimension (src, dst: lists or int64 tensors), every
    source read before any destination is written."""
    src, dst = (torch.as_tensor(x, dtype=torch.int64, device=t.device) for x in (src, dst))
    with torch.inference_mode():
        t.index_copy_(0, dst, t.index_select(0, src))
