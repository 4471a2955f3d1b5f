"""Attention of a ragged batch against the KV cache, grid by grid (rollout/batch.py builds them).

A grid's queries are scattered out of the batch's [N, H, D] queries into a padded grid, attend
to the cache's keys of R consecutive slots read in place, and are gathered back into the
batch's token order. `plan` derives, once per forward, each grid's scatter indices and masks;
`attend` runs every grid of one layer.

On the CPU a grid is two batched matmuls around a float32 softmax (`_attend_matmul`), not torch's
flash kernel, for the invariant (DESIGN.md): the flash kernel's result for a query changes with
the grid's key length and query length (its key blocks are sized from them), so a verify row
would not reproduce its decode. Here the scores are keys @ queries^T (the key length is the
matmul's row count, never a reduction), padded keys get exactly zero probability, and the query
heads that share a KV head are folded into the queries' axis ([R, KV, H/KV * L, D]). oneDNN's
bfloat16 matmuls then give a query the same bits in any grid, prompt chunks included, in either
orientation, so bfloat16 takes the faster one there, queries @ keys^T (`_attend_onednn`). MKL's
float32/float64 matmuls pick their kernel by the number of query columns (1-4 and 8 share one,
5, 6, 7 and 12+ others) and of probability rows (1-3 one, 4+ another), so there the folded
queries go through the matmuls in chunks of 4 or 8 (`_chunks`), a short last chunk padded with
zero queries. Both libraries split a long reduction over keys into blocks sized from its
length (MKL's float32 from a few hundred keys, oneDNN's bfloat16 past 1024), so probs @ values
runs over fixed blocks of `KEY_BLOCK` keys (a batched matmul whose reduction is always that
long; bfloat16: spans of up to `ONEDNN_SPAN`, whose results do not depend on the span's length)
and the partial outputs are summed in order; a grid reads its keys in whole blocks (the extra
ones masked out, the cache allocated in whole blocks), which also keeps softmax rows off
torch's scalar path for rows shorter than a vector register. Every query of every row, decode,
verify or prompt, meets the same kernels (measured on this machine's MKL and oneDNN;
tests/rollout/test_invariance.py fails where another CPU's kernels split differently).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .batch import AttentionGroup
from .kv_cache import KEY_BLOCK, KVCache, blocks_on

QUERY_CHUNKS = (4, 8)  # float32 / float64 on the CPU: folded queries per matmul (see above)
ONEDNN_SPAN = 512  # bfloat16 on the CPU: keys per probs @ values reduction (see above)


def uses_matmul(device: torch.device) -> bool:
    """Whether grids run as `_attend_matmul` (the CPU) rather than torch's fused kernels."""
    return blocks_on(device)


@dataclass
class Grid:
    """One AttentionGroup as a layer runs it.

    CPU: queries folded per KV head ([R, KV, P, D], P = H/KV * L rounded up to whole chunks),
    `target`/`source` scatter them between q.view(N * H, D) and the grid's rows. Accelerators:
    the [R, H, L, D] grid of the group's token_index/pad_index (or a view of a lone row)."""

    group: AttentionGroup
    masks: dict  # window -> additive mask ([R, 1, P, width] float32 on the CPU; None: plain causal)
    width: int  # cached positions read
    padded: int = 0  # P
    chunks: tuple = ()  # (start, size) of the query chunks along P
    source: Optional[torch.Tensor] = None  # [n * H] rows of q.view(N * H, D)
    target: Optional[torch.Tensor] = None  # [n * H] rows of the grid viewed [R * KV * P, D]


def plan(groups: list[AttentionGroup], num_heads: int, num_kv_heads: int, dtype: torch.dtype,
         cache: KVCache, windows: set) -> list[Grid]:
    """Every group's Grid for one forward (its layers share them)."""
    if not groups or not uses_matmul(groups[0].query_pos.device):
        return [Grid(g, {w: g.mask(w, dtype) for w in windows}, g.kv_len) for g in groups]
    return [_cpu_grid(g, num_heads, num_kv_heads, dtype, cache, windows) for g in groups]


def _cpu_grid(group: AttentionGroup, heads: int, kv: int, dtype: torch.dtype, cache: KVCache, windows: set) -> Grid:
    share, length = heads // kv, group.max_row_len
    chunks = _chunks(share * length, dtype)
    padded = chunks[-1][0] + chunks[-1][1]
    width = -(-group.kv_len // KEY_BLOCK) * KEY_BLOCK
    device = group.query_pos.device
    if group.tokens is not None:
        tokens = torch.arange(*group.tokens, device=device)
        slots = torch.arange(length, device=device)
    else:
        tokens, slots = group.token_index, group.pad_index
    head = torch.arange(heads, device=device)
    row, position = slots // length, slots % length
    target = ((row[:, None] * kv + head // share) * padded + head % share * length + position[:, None]).flatten()
    source = (tokens[:, None] * heads + head).flatten()
    masks = {w: _pad_rows(group.mask(w, torch.float32, kernel_causal=False, fold=share, width=width), padded)
             for w in windows}
    return Grid(group, masks, width, padded, tuple(chunks), source, target)


def _pad_rows(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """Extra query rows (chunk padding, zero queries) see key 0 only."""
    extra = rows - mask.shape[2]
    if extra == 0:
        return mask
    pad = torch.full((*mask.shape[:2], extra, mask.shape[3]), float("-inf"), dtype=mask.dtype, device=mask.device)
    pad[..., 0] = 0.0
    return torch.cat([mask, pad], dim=2)


def attend(q: torch.Tensor, grids: list[Grid], cache: KVCache, layer: int, window: Optional[int]) -> torch.Tensor:
    """q: [N, H, D] -> [N, H * D], every grid of `plan` for this layer's window."""
    n, heads, d = q.shape
    out = q.new_empty(n, heads * d)
    if grids and grids[0].target is not None:
        rows_in, rows_out = q.mul(d ** -0.5).view(n * heads, d), out.view(n * heads, d)
        for grid in grids:
            group = grid.group
            keys, values = cache.read(layer, group.first_slot, group.num_rows, grid.width)
            folded = q.new_zeros(group.num_rows * keys.shape[1] * grid.padded, d)
            folded.index_copy_(0, grid.target, rows_in.index_select(0, grid.source))
            o = _attend_matmul(folded.view(group.num_rows, keys.shape[1], grid.padded, d), keys, values,
                               grid.masks[window], grid.chunks)
            rows_out.index_copy_(0, grid.source, o.view(-1, d).index_select(0, grid.target))
        return out
    for grid in grids:
        _attend_fused_group(q, out, grid, cache, layer, window)
    return out


def _attend_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   chunks: tuple) -> torch.Tensor:
    """[R, KV, P, D] scaled queries against [R, KV, K, D] keys and values (K whole blocks);
    mask [R, 1, P, K]."""
    if q.dtype == torch.bfloat16:
        return _attend_onednn(q, keys, values, mask)
    rows, kv, width, d = keys.shape
    blocks = width // KEY_BLOCK
    values = values.reshape(rows, kv, blocks, KEY_BLOCK, d)
    outs = []
    for a, size in chunks:
        scores = torch.matmul(keys, q[:, :, a:a + size].transpose(-1, -2)).transpose(-1, -2)  # [R, KV, size, K]
        probs = torch.softmax(scores + mask[:, :, a:a + size], dim=-1).to(q.dtype)  # float32 softmax
        probs = probs.view(rows, kv, size, blocks, KEY_BLOCK).transpose(2, 3)  # [R, KV, blocks, size, KEY_BLOCK]
        outs.append(torch.matmul(probs, values).sum(dim=2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend_onednn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bfloat16: oneDNN gives a query the same bits for any number of queries, rows and keys in
    queries @ keys^T (the faster orientation there), and in probs @ values for reductions of up
    to ONEDNN_SPAN keys; longer grids sum such spans' outputs in order, in float32."""
    scores = torch.matmul(q, keys.transpose(-1, -2))  # [R, KV, P, K]
    probs = torch.softmax(scores + mask, dim=-1).to(q.dtype)  # float32 softmax
    out = torch.matmul(probs[..., :ONEDNN_SPAN], values[:, :, :ONEDNN_SPAN])
    if keys.shape[2] <= ONEDNN_SPAN:
        return out
    out = out.float()
    for a in range(ONEDNN_SPAN, keys.shape[2], ONEDNN_SPAN):
        out += torch.matmul(probs[..., a:a + ONEDNN_SPAN], values[:, :, a:a + ONEDNN_SPAN])
    return out.to(q.dtype)


def _chunks(folded: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(start, size) of the query chunks: one for oneDNN's bfloat16, else sizes from QUERY_CHUNKS."""
    if dtype == torch.bfloat16:
        return [(0, folded)]
    small, large = QUERY_CHUNKS
    return [(a, small if folded - a <= small else large) for a in range(0, folded, large)]


def _attend_fused_group(q: torch.Tensor, out: torch.Tensor, grid: Grid, cache: KVCache, layer: int,
                        window: Optional[int]) -> None:
    group, (_, heads, d) = grid.group, q.shape
    rows, length = group.num_rows, group.max_row_len
    if group.tokens is not None:
        a, b = group.tokens
        queries = q[a:b].view(1, length, heads, d).transpose(1, 2)
    else:
        queries = q.new_zeros(rows * length, heads, d)
        queries.index_copy_(0, group.pad_index, q.index_select(0, group.token_index))
        queries = queries.view(rows, length, heads, d).transpose(1, 2)
    keys, values = cache.read(layer, group.first_slot, rows, grid.width)
    o = _attend_fused(queries, keys, values, grid.masks[window]).transpose(1, 2).reshape(rows * length, heads * d)
    if group.tokens is not None:
        out[group.tokens[0]:group.tokens[1]] = o
    else:
        out.index_copy_(0, group.token_index, o.index_select(0, group.pad_index))


def _attend_fused(grid: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
    heads, kv = grid.shape[1], keys.shape[1]
    # CUDA's fused attention kernels take grouped KV heads in half precision only; in float32
    # with enable_gqa it falls back to the math path (a dozen kernels a call, launch-bound at
    # decode sizes). Expanding the heads there keeps the memory-efficient kernel.
    if heads != kv:
        keys, values = keys.repeat_interleave(heads // kv, 1), values.repeat_interleave(heads // kv, 1)
    return F.scaled_dot_product_attention(grid, keys, values, attn_mask=mask, is_causal=mask is None)
