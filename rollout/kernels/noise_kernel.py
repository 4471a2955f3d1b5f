"""The CPU kernel for the coupled noise (rollout/kernels/noise_kernel.c): one pass per row, no [rows,
vocabulary] scratch, where torch takes about twenty passes; bit for bit sampling.py's torch
reference (tests/rollout/test_noise_kernel.py).
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import c_kernels
from .c_kernels import I64, PTR

_bind = c_kernels.binder(gumbel_rows=(None, [I64] * 3 + [PTR] * 4), perturbed_argmax_rows=(None, [I64] * 3 + [PTR] * 6))


def load() -> Optional[ctypes.CDLL]:
    """The kernel library, or None where it cannot be had (rollout/kernels/c_kernels.py)."""
    return c_kernels.load("noise_kernel", _bind)


def _rows(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (seeds.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous())


def gumbel(library: ctypes.CDLL, seeds: torch.Tensor, positions: torch.Tensor, hv32: torch.Tensor,
           out: torch.Tensor) -> torch.Tensor:
    """out [M, V] float32 (contiguous, CPU) <- G(seed, position, .); hv32: [V] int32 keys."""
    seeds, positions = _rows(seeds, positions)
    rows, vocab = out.shape
    c_kernels.over_rows(lambda r0, r1: library.gumbel_rows(
        r0, r1, vocab, seeds.data_ptr(), positions.data_ptr(), hv32.data_ptr(), out.data_ptr()), rows)
    return out


def perturbed_argmax(library: ctypes.CDLL, seeds: torch.Tensor, positions: torch.Tensor, hv32: torch.Tensor,
                     z: torch.Tensor, margins: Optional[torch.Tensor] = None) -> torch.Tensor:
    """argmax(z + G) per row of z [M, V] float32 (contiguous, CPU), ties as torch.argmax; margins ([M]
    or None) <- each row's best z + G less its runner-up, as drafter/coupled.py computes it."""
    seeds, positions = _rows(seeds, positions)
    rows, vocab = z.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    gaps = None if margins is None else margins.data_ptr()
    c_kernels.over_rows(lambda r0, r1: library.perturbed_argmax_rows(
        r0, r1, vocab, seeds.data_ptr(), positions.data_ptr(), hv32.data_ptr(), z.data_ptr(), tokens.data_ptr(),
        gaps), rows)
    return tokens
