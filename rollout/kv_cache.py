"""A static, slot-based KV cache: one slot per running request, preallocated once.

A request's keys and values for sequence position p live at [slot, :, p]. Nothing is ever
freed or copied: a rejected draft is rolled back by the engine lowering the request's cached
length, and stale entries beyond it are masked out by position until they are overwritten.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for N tokens at (slots[i], positions[i])."""
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def view(self, layer: int, num_slots: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, num_slots) up to `length`, as views (no copy)."""
        return self.k[layer][:num_slots, :, :length], self.v[layer][:num_slots, :, :length]
