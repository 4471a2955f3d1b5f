"""Attention of a ragged batch against the KV cache, grid by grid (rollout/batch.py builds them).

Each grid's queries are scattered into an [R, H, L, D] tensor (or, for a lone prompt chunk,
are a view of the batch's queries), attend to the cache's keys of R consecutive slots read in
place, and are gathered back into the batch's token order.

torch's scaled_dot_product_attention computes every grid. In bfloat16 on the CPU the query
heads that share a KV head are folded into the query-length axis ([R, KV, H/KV * L, D], each
row with its position's mask row) instead of passing `enable_gqa`: the CPU flash kernel's
grouped-head path in bfloat16 was several times slower than the same kernel on folded heads
(bench_results/speed_attention.json); the values are the same either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import AttentionGroup
from .kv_cache import KVCache


def folds_heads(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped query heads are folded into the query axis (then every grid needs a mask)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def attend(q: torch.Tensor, groups: list[AttentionGroup], cache: KVCache, layer: int,
           masks: list, num_kv_heads: int, fold: bool) -> torch.Tensor:
    """q: [N, H, D] -> [N, H * D]. masks[g]: group g's mask (None: plain causal); fold: see
    `folds_heads`."""
    n, heads, d = q.shape
    out = q.new_empty(n, heads * d)
    # CUDA's fused attention kernels take grouped KV heads in half precision only; in float32
    # with enable_gqa it falls back to the math path (a dozen kernels a call, launch-bound at
    # decode sizes). Expanding the heads there keeps the memory-efficient kernel.
    expand = heads // num_kv_heads if q.is_cuda and heads != num_kv_heads else 1
    for g, group in enumerate(groups):
        rows, length = group.num_rows, group.max_row_len
        if group.tokens is not None:
            a, b = group.tokens
            grid = q[a:b].view(1, length, heads, d).transpose(1, 2)
        else:
            grid = q.new_zeros(rows * length, heads, d)
            grid.index_copy_(0, group.pad_index, q.index_select(0, group.token_index))
            grid = grid.view(rows, length, heads, d).transpose(1, 2)
        keys, values = cache.read(layer, group.first_slot, rows, group.kv_len)
        mask = masks[g]
        if fold and heads != num_kv_heads:
            o = _attend_folded(grid, keys, values, mask)
        else:
            if expand > 1:
                keys, values = keys.repeat_interleave(expand, 1), values.repeat_interleave(expand, 1)
            o = F.scaled_dot_product_attention(grid, keys, values, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=expand == 1 and heads != num_kv_heads)
        o = o.transpose(1, 2).reshape(rows * length, heads * d)
        if group.tokens is not None:
            out[group.tokens[0]:group.tokens[1]] = o
        else:
            out.index_copy_(0, group.token_index, o.index_select(0, group.pad_index))
    return out


def _attend_folded(grid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """[R, H, L, D] queries against [R, KV, K, D] keys and values with an [R, 1, L, K] mask: the
    H // KV query heads of a KV head become H // KV * L query rows of one head."""
    rows, heads, length, d = grid.shape
    kv, kv_len = keys.shape[1], keys.shape[2]
    share = heads // kv
    q = grid.reshape(rows, kv, share * length, d)
    mask = mask[:, :, None].expand(rows, 1, share, length, kv_len).reshape(rows, 1, share * length, kv_len)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).view(rows, heads, length, d)
