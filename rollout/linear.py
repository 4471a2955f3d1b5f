"""The model's linear layers as the CPU runs them fastest: oneDNN with weights packed once.

torch's `F.linear` sends float32 to MKL's sgemm, which on this kind of CPU reaches about half the
matmul throughput oneDNN does with its weights reordered ahead of time into its blocked layout
(prepacked), and whose result for a row changes with how many rows share the call (a different
kernel for one, two to three, and four or more rows). oneDNN's packed kernels in float32 and
bfloat16 give a row the same bits for any row count from two up, but a single row takes another
kernel when the input is wide (the MLP's down projection). So a call with fewer rows than its
kernel's stable range (`min_rows`: 2 packed, 4 for MKL) runs padded with copies of its first
row. That is what speculation relies on: a verify row must be computed the way a decode row is,
whatever else shares the forward (tests/rollout/test_invariance.py).

Projections that read the same input are fused into one packed matmul (q|k|v, gate|up); the
Hugging Face-named modules stay the weights' owners (load_weights, state_dict), the packs are
derived copies, rebuilt by `pack_projections` after any change. Where oneDNN cannot help
(float64, or any device but the CPU) each projection stays a plain `F.linear` on the module's own
weight, so nothing is duplicated on an accelerator.

The packed call is torch's own oneDNN operator, the one inductor's weight prepacking emits
(torch/_inductor/fx_passes/mkldnn_fusion.py: `_reorder_linear_weight` then `_linear_pointwise`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# The row count the packed layout is tuned for; any row count works with it. A decode step's rows.
PACK_ROWS = 32
PACKED_MIN_ROWS = 2  # oneDNN: one row of a wide input takes another kernel than two or more
PLAIN_MIN_ROWS = 4  # MKL (float64, and float32 without oneDNN): kernels for 1, 2-3 and 4+ rows


def packs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers of this device and dtype run packed through oneDNN."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())


@dataclass
class Projection:
    """One or more linear maps of the same input: `proj(x)` returns their outputs, in order.

    Packed: one oneDNN weight for all of them (outputs are column slices of one matmul).
    Plain: the modules' own weights, one F.linear each."""

    sizes: tuple[int, ...]
    packed: Optional[torch.Tensor]  # oneDNN weight [sum(sizes), in] or None
    bias: Optional[torch.Tensor]  # fused bias for the packed weight
    plain: tuple[tuple[torch.Tensor, Optional[torch.Tensor]], ...]  # (weight, bias) per map when not packed
    min_rows: int  # calls with fewer rows run padded to this many (see above)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """The maps of x; with residual (one map only), map(x) + residual in one pass."""
        n = x.shape[0]
        if n == 0:  # a forward that wants no logits (a draft head's features only)
            return [x.new_empty(0, size) for size in self.sizes]
        if n < self.min_rows:
            x = _pad_rows(x, self.min_rows)
            residual = None if residual is None else _pad_rows(residual, self.min_rows)
        if self.packed is not None:
            if residual is not None:
                ys = [torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")]
            else:
                y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
                ys = [y] if len(self.sizes) == 1 else list(y.split(self.sizes, dim=-1))
        else:
            ys = [F.linear(x, w, b) for w, b in self.plain]
            if residual is not None:
                ys[0] = ys[0] + residual
        return ys if n >= self.min_rows else [y[:n] for y in ys]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])


def projection(linears: Sequence[nn.Linear], pack: bool) -> Projection:
    sizes = tuple(m.out_features for m in linears)
    plain = tuple((m.weight, m.bias) for m in linears)
    if not pack:
        return Projection(sizes, None, None, plain, PLAIN_MIN_ROWS if plain[0][0].device.type == "cpu" else 1)
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([m.bias for m in linears]).contiguous()
    return Projection(sizes, packed, bias, (), PACKED_MIN_ROWS)


def weights_version(module: nn.Module) -> tuple:
    """Changes whenever a parameter is written in place or replaced: packs built at one version
    are stale at another."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in module.parameters())
