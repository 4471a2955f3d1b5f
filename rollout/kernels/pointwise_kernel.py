"""A decoder layer's row-wise operations through rollout/kernels/pointwise_kernel.c on the CPU, in float32
or bfloat16 and outside autograd, one pass per row where torch takes several: the rotary embedding
with the bits of `ops.rotate`'s torch expression, and RMSNorm in a fixed order of its own (a
row's result depends on that row alone)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import c_kernels
from .c_kernels import FLOAT, I64, PTR

_bind = c_kernels.binder(rotate_rows=(None, [I64] * 3 + [PTR] * 4), rotate_rows_bf16=(None, [I64] * 3 + [PTR] * 4),
                         rms_norm_rows=(None, [I64, I64, PTR, PTR, FLOAT, PTR]),
                         rms_norm_rows_bf16=(None, [I64, I64, PTR, PTR, FLOAT, PTR, PTR]))


def load() -> Optional[ctypes.CDLL]:
    return c_kernels.load("pointwise_kernel", _bind)


def _applies(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.bfloat16) and all(
        t.dtype == dtype and t.device.type == "cpu" for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """`ops.rotate(x, cos, sin)` for x [N, heads, D] and cos, sin [N, 1, D]; None where the
    kernel does not apply (the caller runs torch's)."""
    if (x.dim() != 3 or x.shape[-1] % 2 or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape
            or not _applies(x, cos, sin)):
        return None
    library = load()
    if library is None:
        return None
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    run = library.rotate_rows if x.dtype == torch.float32 else library.rotate_rows_bf16
    run(x.shape[0], x.shape[1], x.shape[2], x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """RMSNorm of x [..., D] with weight [D]; None where the kernel does not apply."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0] or not _applies(x, weight):
        return None
    library = load()
    if library is None:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    rows, width = x.numel() // weight.shape[0], weight.shape[0]
    if x.dtype == torch.float32:
        library.rms_norm_rows(rows, width, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    else:
        wide = torch.empty(width, dtype=torch.float32)
        library.rms_norm_rows_bf16(rows, width, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), wide.data_ptr())
    return out
