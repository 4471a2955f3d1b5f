"""Attention on the CPU through rollout/kernels/attention_kernel.c: each token attends to its own slot's
cached keys up to its position by a fixed sequence of arithmetic, so its output has the same bits
in any batch. It replaces, on the CPU, the padded grids of rollout/core/batch.py and torch's fused
attention, whose blocking depends on the grid's shape (`model.invariant_grid`), and reads only the
keys a token sees, in float32 arithmetic for float32 and bfloat16 caches.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import c_kernels
from .c_kernels import FLOAT, I64, INT, PTR

_bind = c_kernels.binder(attend_tokens=(INT, [I64] * 7 + [INT] + [PTR] * 5 + [I64, FLOAT, PTR]),
                         write_keys=(None, [I64] * 5 + [PTR] * 4), write_values=(None, [I64] * 5 + [PTR] * 4))


def load() -> Optional[ctypes.CDLL]:
    return c_kernels.load("attention_kernel", _bind)


MAX_GROUP = 16  # query heads per key/value head at most (the C file's)


def supports(device: torch.device, dtype: torch.dtype, heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel can run a model's attention (else the model uses torch's)."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and heads % num_kv_heads == 0
            and heads // num_kv_heads <= MAX_GROUP and load() is not None)


def key_stride(k_cache: torch.Tensor) -> Optional[int]:
    """The entries from one key row to the next of a transposed key cache [slots, Hkv, D, max_len]
    whose rows may be padded (rollout/core/kv_cache.py), or None where it is not laid out so."""
    s, (_, kv, d, length) = k_cache.stride(), k_cache.shape
    if s[3] != 1 or s[2] < length or s[1] != d * s[2] or s[0] != kv * s[1]:
        return None
    return s[2]


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """q [N, H, D] -> [N, H, D]: token i attends to slot slots[i]'s positions up to positions[i]
    (the last `window` of them with one). k_cache [slots, Hkv, D, max_len] (transposed, rows maybe
    padded), v_cache [slots, Hkv, max_len, D], already holding the tokens' own keys and values."""
    library = load()
    q = q.contiguous()
    n, heads, head_dim = q.shape
    num_kv_heads, max_len = v_cache.shape[1], v_cache.shape[2]
    stride = key_stride(k_cache)
    if k_cache.shape != (v_cache.shape[0], num_kv_heads, head_dim, max_len) or stride is None:
        raise ValueError(f"attention kernel: keys {tuple(k_cache.shape)} (strides {k_cache.stride()}) are not the "
                         f"transposed layout of values {tuple(v_cache.shape)}")
    slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    bf16 = int(q.dtype == torch.bfloat16)
    scale = head_dim ** -0.5

    def run(t0: int, t1: int) -> int:
        return library.attend_tokens(t0, t1, heads, num_kv_heads, head_dim, max_len, stride, bf16, q.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), positions.data_ptr(),
                                     window or 0, scale, out.data_ptr())

    codes = c_kernels.over_rows(run, n)
    if any(codes):
        raise RuntimeError(f"attention kernel failed (code {min(codes)}): -1 no scratch memory for {max_len} "
                           f"positions, -2 more than {MAX_GROUP} query heads per key/value head")
    return out


def write_keys(k_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor) -> None:
    """k_cache[slots[i], :, :, positions[i]] = k[i] for a transposed key cache (rows maybe padded) and k
    [N, Hkv, D]; slots and positions must be in range (the engine's are)."""
    library = load()
    stride = key_stride(k_cache)
    if library is None or k_cache.device.type != "cpu" or stride is None or k_cache.element_size() not in (2, 4):
        k_cache[slots, :, :, positions] = k
        return
    k = k.to(k_cache.dtype).contiguous()
    slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    library.write_keys(k.shape[0], k_cache.shape[1], k_cache.shape[2], stride, k_cache.element_size(),
                       k.data_ptr(), k_cache.data_ptr(), slots.data_ptr(), positions.data_ptr())


def write_values(v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, v: torch.Tensor) -> None:
    """v_cache[slots[i], :, positions[i]] = v[i] for a value cache [slots, Hkv, max_len, D] and v
    [N, Hkv, D]; as `write_keys`, slots and positions must be in range."""
    library = load()
    if (library is None or v_cache.device.type != "cpu" or not v_cache.is_contiguous()
            or v_cache.element_size() not in (2, 4)):
        v_cache[slots, :, positions] = v
        return
    v = v.to(v_cache.dtype).contiguous()
    slots, positions = slots.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
    library.write_values(v.shape[0], v_cache.shape[1], v_cache.shape[3], v_cache.shape[2], v_cache.element_size(),
                         v.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), positions.data_ptr())
