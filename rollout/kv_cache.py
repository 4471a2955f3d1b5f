"""A static, slot-based KV cache: one slot per running request, preallocated once.

A request's keys and values for sequence position p live at [slot, :, p]. Nothing is ever
freed or copied: a rejected draft is rolled back by the engine lowering the request's cached
length, and stale entries beyond it are masked out by position until they are overwritten.
Attention reads a run of consecutive slots in place (`read`), so the layout keeps each head's
positions contiguous. On the CPU it reads whole blocks of `KEY_BLOCK` positions (rollout/attention.py),
so there the cache holds whole blocks.
"""
from __future__ import annotations

import torch

KEY_BLOCK = 64  # the CPU's attention reads keys, and reduces probs @ values, in blocks of this many


def blocks_on(device: torch.device | str) -> bool:
    """Whether attention on this device reads whole KEY_BLOCKs (the CPU's matmul attention)."""
    return torch.device(device).type == "cpu"


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        """Positions 0 .. max_len - 1 per slot; on the CPU the storage runs on to whole KEY_BLOCKs
        (`stored_len`), which attention reads but nothing writes."""
        self.stored_len = -(-max_len // KEY_BLOCK) * KEY_BLOCK if blocks_on(device) else max_len
        shape = (num_slots, num_kv_heads, self.stored_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N * kv_heads] rows of the flattened cache (slot, head, position) that N tokens at
        (slots[i], positions[i]) write, token-major: computed once per forward for all layers."""
        heads = torch.arange(self.num_kv_heads, device=slots.device)
        return ((slots[:, None] * self.num_kv_heads + heads) * self.stored_len + positions[:, None]).reshape(-1)

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim]; index: `write_index` of their tokens."""
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def read(self, layer: int, first_slot: int, num_slots: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, kv_heads, length, head_dim] of slots first_slot .. + R - 1: views."""
        end = first_slot + num_slots
        return self.k[layer][first_slot:end, :, :length], self.v[layer][first_slot:end, :, :length]
