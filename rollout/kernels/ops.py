"""The engine's operations behind one seam: each runs its CPU C kernel (rollout/kernels/*_kernel.py) where
that is built and applies, else torch, the default (CUDA, autograd, other dtypes, no compiler).
The two give the same bits, so which ran never shows in a token."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import attention_kernel, noise_kernel, pointwise_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = pointwise_kernel.rms_norm(x, weight, eps)
    if out is not None:
        return out
    # Normalise in float32 and cast back before the weight, as transformers does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, 1, D]. The half-split rotation of the HF checkpoints."""
    out = pointwise_kernel.rotate(x, cos, sin)
    if out is not None:
        return out
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention_in_kernel(device: torch.device, dtype: torch.dtype, heads: int, num_kv_heads: int) -> bool:
    """Whether a model's attention runs in the CPU kernel (over a cache with transposed keys)."""
    return attention_kernel.supports(device, dtype, heads, num_kv_heads)


def attend(q, k_cache, v_cache, slots, positions, window: Optional[int]) -> torch.Tensor:
    """The CPU kernel's attention; torch's runs on grids (rollout/core/model.py), as a GPU wants them."""
    return attention_kernel.attend(q, k_cache, v_cache, slots, positions, window)


def noise_library(device: torch.device) -> Optional[ctypes.CDLL]:
    """The coupled noise's CPU kernel, else None (rollout/core/sampling.py's torch code runs)."""
    return noise_kernel.load() if device.type == "cpu" else None
