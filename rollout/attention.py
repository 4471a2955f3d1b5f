"""Attention of a ragged batch against the KV cache, grid by grid (rollout/batch.py builds them).

Each grid's queries are scattered into an [R, H, L, D] tensor (or, for a lone prompt chunk,
are a view of the batch's queries), attend to the cache's keys of R consecutive slots read in
place, and are gathered back into the batch's token order.

On the CPU a grid is two batched matmuls around a float32 softmax (`_attend_matmul`), not torch's
flash kernel, for the invariant (DESIGN.md): the flash kernel's result for a query changes with
the grid's key length and query length (its key blocks are sized from them), so a verify row
would not reproduce its decode. Here the scores are keys @ queries^T (the key length is the
matmul's row count, never a reduction), padded keys get exactly zero probability, and the query
heads that share a KV head are folded into the queries' axis ([R, KV, H/KV * L, D]). oneDNN's
bfloat16 matmuls then give a query the same bits in any grid, prompt chunks included. MKL's
float32/float64 matmuls pick their kernel by the number of query columns (1-4 and 8 share one,
5, 6, 7 and 12+ others) and of probability rows (1-3 one, 4+ another), so there the folded
queries go through the matmuls in chunks of 4 or 8 (`_chunks`), a short last chunk padded by
repeating a query: every query of every row, decode, verify or prompt, meets the same kernels
(measured on this machine's MKL; tests/rollout/test_invariance.py fails where another CPU's
kernels split differently). torch's softmax takes a scalar path for rows shorter than a vector
register and a vectorised one from there on (other bits), so a grid reads at least `MIN_KEYS`
cached positions (the extra ones masked out).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .batch import AttentionGroup
from .kv_cache import KVCache

QUERY_CHUNKS = (4, 8)  # float32 / float64 on the CPU: folded queries per matmul (see above)
MIN_KEYS = 16  # keys a grid reads at least on the CPU: softmax rows as long as an AVX-512 register


def key_width(group: AttentionGroup, cache: KVCache) -> int:
    """How many cached positions a CPU grid reads: its K, at least MIN_KEYS (within the cache)."""
    return max(group.kv_len, min(MIN_KEYS, cache.max_len))


def uses_matmul(device: torch.device) -> bool:
    """Whether grids run as `_attend_matmul` (then every grid needs an explicit mask)."""
    return device.type == "cpu"


def attend(q: torch.Tensor, groups: list[AttentionGroup], cache: KVCache, layer: int,
           masks: list, num_kv_heads: int) -> torch.Tensor:
    """q: [N, H, D] -> [N, H * D]. masks[g]: group g's additive mask, whose width is the keys
    read (None: plain causal over the group's K)."""
    n, heads, d = q.shape
    out = q.new_empty(n, heads * d)
    for g, group in enumerate(groups):
        rows, length = group.num_rows, group.max_row_len
        if group.tokens is not None:
            a, b = group.tokens
            grid = q[a:b].view(1, length, heads, d).transpose(1, 2)
        else:
            grid = q.new_zeros(rows * length, heads, d)
            grid.index_copy_(0, group.pad_index, q.index_select(0, group.token_index))
            grid = grid.view(rows, length, heads, d).transpose(1, 2)
        mask = masks[g]
        keys, values = cache.read(layer, group.first_slot, rows, group.kv_len if mask is None else mask.shape[-1])
        if uses_matmul(q.device):
            o = _attend_matmul(grid, keys, values, mask)
        else:
            o = _attend_fused(grid, keys, values, mask)
        o = o.transpose(1, 2).reshape(rows * length, heads * d)
        if group.tokens is not None:
            out[group.tokens[0]:group.tokens[1]] = o
        else:
            out.index_copy_(0, group.token_index, o.index_select(0, group.pad_index))
    return out


def _attend_matmul(grid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] queries against [R, KV, K, D] keys and values; mask [R, 1, H/KV * L, K]
    float32, folded (`AttentionGroup.mask(fold=H // KV)`)."""
    rows, heads, length, d = grid.shape
    kv, kv_len = keys.shape[1], keys.shape[2]
    folded = heads // kv * length
    q = grid.reshape(rows, kv, folded, d)
    outs = []
    for a, size in _chunks(folded, grid.dtype):
        qc, mc = q[:, :, a:a + size], mask[:, :, a:a + size]
        if qc.shape[2] < size:  # pad by repeating the first query (and its mask row)
            pad = size - qc.shape[2]
            qc = torch.cat([qc, qc[:, :, :1].expand(rows, kv, pad, d)], dim=2)
            mc = torch.cat([mc, mc[:, :, :1].expand(rows, 1, pad, kv_len)], dim=2)
        scores = torch.matmul(keys, qc.transpose(-1, -2)).transpose(-1, -2).float()  # [R, KV, chunk, K]
        probs = torch.softmax(scores.mul_(d ** -0.5).add_(mc), dim=-1).to(grid.dtype)
        outs.append(torch.matmul(probs, values))
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return o[:, :, :folded].reshape(rows, heads, length, d)


def _chunks(folded: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(start, size) of the query chunks: one for oneDNN's bfloat16, else sizes from QUERY_CHUNKS."""
    if dtype == torch.bfloat16:
        return [(0, folded)]
    small, large = QUERY_CHUNKS
    return [(a, small if folded - a <= small else large) for a in range(0, folded, large)]


def _attend_fused(grid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
    heads, kv = grid.shape[1], keys.shape[1]
    # CUDA's fused attention kernels take grouped KV heads in half precision only; in float32
    # with enable_gqa it falls back to the math path (a dozen kernels a call, launch-bound at
    # decode sizes). Expanding the heads there keeps the memory-efficient kernel.
    if heads != kv:
        keys, values = keys.repeat_interleave(heads // kv, 1), values.repeat_interleave(heads // kv, 1)
    if mask is not None:
        mask = mask.to(grid.dtype)
    return F.scaled_dot_product_attention(grid, keys, values, attn_mask=mask, is_causal=mask is None)
