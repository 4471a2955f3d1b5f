"""The engine's linear layers on the CPU (docs/architecture.md, `linear.py`): oneDNN with each
weight packed once (inductor's prepacking path, `_reorder_linear_weight` / `_linear_pointwise`),
cheap at small row counts where MKL's sgemm repacks every call, and giving a row the same bits
for any row count from two up (one-row calls run as two); bfloat16 on AMX through
rollout/kernels/amx_linear.py; weights too small for oneDNN in float32 through rollout/kernels/linear_kernel.py.
A pack is a derived copy of the module's weight, which stays the owner: rebuilt when it changes.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import amx_linear, linear_kernel

# Weights with fewer numbers than this (a tiny model's) run faster unpacked (MKL or linear_kernel).
PACK_MIN_WEIGHTS = 1 << 17
PACK_ROWS = 32  # the row count oneDNN tunes the packed layout for; any row count works with it
MIN_ROWS = 2  # one row of a wide input takes another kernel than two or more
# oneDNN builds and caches a kernel per row count and weight shape. Calls of up to EXACT_ROWS rows
# run as they are (a draft token beside a decode batch costs one row, as rollout/budget/budget.py
# assumes); larger ones are padded to a multiple of 1/PAD_PARTS of their power of two, so each
# doubling of the row count adds PAD_PARTS kernels per shape.
EXACT_ROWS = 128
PAD_PARTS = 16


def packs(weight: torch.Tensor) -> bool:
    """Whether a linear layer with this weight runs packed through oneDNN (bfloat16 only where the
    CPU has oneDNN's bfloat16 path)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.numel() >= PACK_MIN_WEIGHTS and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and (weight.dtype == torch.float32 or onednn_bf16()))


@functools.lru_cache(maxsize=1)
def onednn_bf16() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 matmuls (the check inductor's weight prepacking makes)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def padded_rows(n: int) -> int:
    """The rows a call of n rows runs with (the extra ones are copies of its first row)."""
    if n < MIN_ROWS:
        return MIN_ROWS
    if n <= EXACT_ROWS:
        return n
    step = 1 << max(n.bit_length() - PAD_PARTS.bit_length(), 0)  # n's power of two / PAD_PARTS
    return -(-n // step) * step


class PackedLinear(nn.Linear):
    """nn.Linear that runs through `make_route`'s call outside autograd, and plain elsewhere
    (one-row bfloat16 CPU calls as two rows, as above)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            route = self._route()
            if route is not None:
                return route(x, self.bias)
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return super().forward(x.repeat(2, 1))[:1]
        return super().forward(x)

    def _route(self):
        """make_route's call for the current weight, rebuilt when the weight object, its storage or
        its version (any in-place write) changed."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        cached: Optional[tuple] = self.__dict__.get("_packed")
        if cached is None or cached[1] != key or cached[0]() is not w:
            with torch.no_grad():
                route = make_route(w.detach().contiguous())
            cached = self.__dict__["_packed"] = (weakref.ref(w), key, route)
        return cached[2]

    def __getstate__(self):
        # A copy repacks on its first call (a pack may hold a library handle, which does not pickle).
        state = super().__getstate__()
        state.pop("_packed", None)
        return state


def make_route(w: torch.Tensor) -> Optional[Callable]:
    """The call (x, bias) -> y that runs a linear layer with the (detached, contiguous) weight w
    outside autograd: amx_linear, else oneDNN, else linear_kernel, each with w packed; None: torch's."""
    amx = amx_linear.load() if w.device.type == "cpu" and w.dtype == torch.bfloat16 else None
    if amx is not None:
        return functools.partial(amx_linear.linear, amx, amx_linear.pack(amx, w), w.shape[0])
    if w.numel() >= PACK_MIN_WEIGHTS and packs(w):
        return functools.partial(_onednn_forward, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS), w.shape[0])
    library = linear_kernel.load() if w.device.type == "cpu" and w.dtype == torch.float32 else None
    if library is None:
        return None
    return functools.partial(linear_kernel.linear, library, linear_kernel.pack(library, w), w.shape[0])


def bound(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> F.linear(x, weight, bias) through make_route's call, for a weight no module owns (the
    draft head's projections packed into one). It holds a pack: a later write is not seen."""
    with torch.no_grad():
        route = make_route(weight.detach().contiguous())
    if route is None:
        return functools.partial(F.linear, weight=weight, bias=bias)
    return lambda x: route(x, bias)


def _onednn_forward(packed: torch.Tensor, n_out: int, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    n = x.shape[0]
    if n == 0:  # no row to pad from (a forward that asks no logits); the result is empty as nn.Linear's
        return x.new_empty(*shape[:-1], n_out)
    rows = padded_rows(n)
    if rows != n:
        x = torch.cat([x, x[:1].expand(rows - n, -1)])
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y[:n].reshape(*shape[:-1], y.shape[-1])
