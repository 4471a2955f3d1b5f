"""Exact bfloat16 linear layers at AMX's speed through rollout/kernels/amx_kernel.c, where the CPU has AMX
tiles and Linux lets the process use them. oneDNN's AMX kernels choose their blocking by the row
count, so spectail caps oneDNN below AMX (rollout/kernels/cpu_isa.py); this kernel sums each output in one
fixed order of tile instructions and splits only columns between threads: a row gets the same
bits in any call.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from . import c_kernels
from .c_kernels import I64, INT, PTR

PANEL = 16  # output columns per tile (the C file's)
KBLOCK = 32  # k per tile instruction (the C file's)
_bind = c_kernels.binder(pack_weight=(None, [I64] * 3 + [PTR] * 2), linear_panels=(None, [I64] * 5 + [PTR] * 4),
                         amx_ready=(INT, []))


@functools.lru_cache(maxsize=1)
def load() -> Optional[ctypes.CDLL]:
    """The kernel library where it was built with AMX and the process may use its tiles, else None."""
    library = c_kernels.load("amx_kernel", _bind)
    return library if library is not None and library.amx_ready() else None


def padded_k(k: int) -> int:
    return -(-k // KBLOCK) * KBLOCK


def pack(library: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 -> the tiles' layout [ceil(N / 16), K' / 2, 16, 2] (K' = K rounded to 32)."""
    w = weight.detach().contiguous()
    n, k = w.shape
    kp = padded_k(k)
    packed = torch.empty(-(-n // PANEL), kp // 2, PANEL, 2, dtype=torch.bfloat16)
    library.pack_weight(n, k, kp, w.data_ptr(), packed.data_ptr())
    return packed


def linear(library: ctypes.CDLL, packed: torch.Tensor, n: int, x: torch.Tensor,
           bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] bfloat16 (CPU) times the packed weight of n outputs, plus bias ([n] or None), in bfloat16."""
    shape = x.shape
    if x.dim() != 2:
        x = x.reshape(-1, shape[-1])
    kp = packed.shape[1] * 2
    if x.shape[1] != kp:
        x = F.pad(x, (0, kp - x.shape[1]))
    x = x.contiguous()
    rows, panels = x.shape[0], packed.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    b = None if bias is None else bias.detach().to(torch.float32)
    args = (rows, kp, n, x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr())
    if torch.get_num_threads() == 1 or panels < 2 * c_kernels.MIN_ROWS_PER_THREAD:
        library.linear_panels(0, panels, *args)  # (most calls: no thread hand-off to arrange)
    elif rows:
        # Columns are independent, so a split between threads never changes a value.
        c_kernels.over_rows(lambda p0, p1: library.linear_panels(p0, p1, *args), panels)
    return out if len(shape) == 2 else out.view(*shape[:-1], n)
