"""The draft head's attention on the CPU through drafter/head_kernel.c: rotate the new rows' keys,
write them and their values into the head's cache, attend from each request's last row (for a
float32 head; HeadCache.attend_rows runs the same steps in torch elsewhere).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from rollout.kernels import c_kernels
from rollout.kernels.c_kernels import FLOAT, I64, INT, PTR

HERE = Path(__file__).parent
_bind = c_kernels.binder(head_write_rows=(None, [I64] * 6 + [PTR] * 7),
                         head_attend_rows=(INT, [I64] * 7 + [FLOAT] + [PTR] * 9))


def load() -> Optional[ctypes.CDLL]:
    return c_kernels.load("head_kernel", _bind, HERE)


MAX_DIM, MAX_ROWS, LANES = 512, 4096, 16  # the C files': head_dim, cache rows, and rows a multiple of LANES


def cache_rows(rows: int) -> int:
    """The rows a kernel cache keeps for `rows`: whole vectors of cells (a longer ring changes
    nothing: a query reads its window, and a draft row never lands inside a later one's)."""
    return -(-rows // LANES) * LANES


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, rows: int) -> bool:
    """Whether the kernel can run a head's attention over a cache of `rows` rows per slot."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim <= MAX_DIM
            and cache_rows(rows) <= MAX_ROWS and load() is not None)


def write_and_attend(qkv: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                     sin_signed: torch.Tensor, row_slots: torch.Tensor, positions: torch.Tensor,
                     last: Optional[torch.Tensor], window: Optional[int]) -> torch.Tensor:
    """Writes every new row's rotated key and value (qkv [N, heads + 2 kv, D]) into the transposed
    keys [slots, kv, D, R] and values [slots, kv, R, D], then attends from rows `last` (None: all)."""
    library = load()
    kv, kept, dim = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    n = qkv.shape[0]
    qkv, row_slots, positions = qkv.contiguous(), row_slots.contiguous(), positions.contiguous()
    last = None if last is None else last.contiguous()
    c, last_ptr = (n, None) if last is None else (last.shape[0], last.data_ptr())  # (NULL: every row attends)
    out = torch.empty(c, heads * dim, dtype=torch.float32)
    library.head_write_rows(0, n, heads, kv, dim, kept, qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                            row_slots.data_ptr(), positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def run(c0: int, c1: int) -> int:
        return library.head_attend_rows(c0, c1, heads, kv, dim, kept, window or 0, dim ** -0.5, qkv.data_ptr(),
                                        cos.data_ptr(), sin_signed.data_ptr(), last_ptr, row_slots.data_ptr(),
                                        positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())

    if any(c_kernels.over_rows(run, c)):
        raise RuntimeError(f"head attention kernel: a head wider than {MAX_DIM}, or a cache of more than {MAX_ROWS} "
                           f"rows or of rows not a multiple of {LANES}")
    return out
