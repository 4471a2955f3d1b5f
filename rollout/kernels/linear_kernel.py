"""Small float32 linear layers on the CPU through rollout/kernels/linear_kernel.c, where the CPU has
AVX-512 or AVX2 with FMA (the same chains of fused multiply-adds on both: the same bits). MKL's
sgemm takes other kernels for one to three rows than for four or more, so a row's bits depended on
the step; the kernel computes every output by one chain in any call.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import c_kernels
from .c_kernels import I64, INT, PTR

PANEL = 16  # output columns per packed panel (the C file's)
_bind = c_kernels.binder(pack_weight=(None, [I64, I64, PTR, PTR]), linear_rows=(None, [I64] * 4 + [PTR] * 4),
                         linear_vectorized=(INT, []))


def load() -> Optional[ctypes.CDLL]:
    """The kernel library where it was built with its vector path, else None (the slower
    one-output-at-a-time path is only there to keep the C file whole on other CPUs)."""
    library = c_kernels.load("linear_kernel", _bind)
    return library if library is not None and library.linear_vectorized() else None


def pack(library: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> its panels [ceil(N / PANEL), K, PANEL], zero past N."""
    w = weight.detach().contiguous()
    n, k = w.shape
    packed = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32)
    library.pack_weight(n, k, w.data_ptr(), packed.data_ptr())
    return packed


def linear(library: ctypes.CDLL, packed: torch.Tensor, n: int, x: torch.Tensor,
           bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] float32 (CPU) times the packed weight of n outputs, plus bias ([n] float32 or None)."""
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    x = x.contiguous()
    rows, k = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    args = (k, n, x.data_ptr(), packed.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
            out.data_ptr())
    if rows < 2 * c_kernels.MIN_ROWS_PER_THREAD or torch.get_num_threads() == 1:
        library.linear_rows(0, rows, *args)  # (most calls: no thread hand-off to arrange)
    else:
        c_kernels.over_rows(lambda r0, r1: library.linear_rows(r0, r1, *args), rows)
    return out if len(shape) == 2 else out.view(*shape[:-1], n)
