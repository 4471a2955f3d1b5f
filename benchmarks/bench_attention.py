"""The CPU attention kernel on verify rows: a request's consecutive tokens read its keys and values
together (rollout/kernels/attention_kernel.c, attend_rows) against the same tokens one at a time.

The same tokens, caches and arithmetic go through the kernel twice per round: in row order
(each slot's tokens at consecutive positions, as a verify step or a prompt chunk feeds them), and
interleaved across slots (token i of every slot, then token i + 1: no two neighbours share a
slot, so each is attended alone). Outputs must have the same bits. Prints microseconds per token
(median over rounds, interleaved) and the ratio; writes JSON. The interleaved order also loses
the cache reuse that neighbouring tokens of one slot get anyway, so its ratio is more than what
the shared loads alone buy.

    python -m benchmarks.bench_attention [--contexts 30,100,300] [--per-row 1,5,9,25] [--out ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench import report_cases
from rollout.kernels import attention_kernel


def tokens(slots: int, per_row: int, context: int, heads: int, head_dim: int, seed: int = 0):
    """Queries, slots and positions of `per_row` consecutive tokens after `context` cached ones in
    each slot, in row order, and the order that interleaves the slots."""
    gen = torch.Generator().manual_seed(seed)
    slot = torch.arange(slots).repeat_interleave(per_row)
    position = (context + torch.arange(per_row)).repeat(slots)
    q = torch.randn(slots * per_row, heads, head_dim, generator=gen)
    interleaved = torch.arange(slots * per_row).view(slots, per_row).t().reshape(-1)
    return q, slot, position, interleaved


def measure(args, context: int, per_row: int, k: torch.Tensor, v: torch.Tensor) -> dict:
    q, slot, position, order = tokens(args.slots, per_row, context, args.heads, args.head_dim)
    seconds = {"rows": [], "interleaved": []}
    outs = {}
    for _ in range(args.rounds):
        for name, index in (("rows", None), ("interleaved", order)):
            qi, si, pi = (q, slot, position) if index is None else (q[index], slot[index], position[index])
            start = time.perf_counter()
            outs[name] = attention_kernel.attend(qi, k, v, si, pi, None)
            seconds[name].append(time.perf_counter() - start)
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order))
    n = len(slot)
    result = {"context": context, "per_row": per_row, "tokens": n,
              "identical": bool(torch.equal(outs["interleaved"][back], outs["rows"]))}
    for name, s in seconds.items():
        result[f"{name}_us_per_token"] = 1e6 * statistics.median(s) / n
    result["interleaved_over_rows"] = statistics.median(a / b for a, b in zip(seconds["interleaved"], seconds["rows"]))
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="30,100,300", help="cached positions before each slot's tokens")
    ap.add_argument("--per-row", dest="per_row", default="1,5,9,25", help="tokens per slot (1: decoding)")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=2)
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=32, help="(defaults: the demo policy's)")
    ap.add_argument("--max-len", dest="max_len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_results/attention_rows.json")
    args = ap.parse_args(argv)
    if attention_kernel.load() is None:
        raise SystemExit("the CPU attention kernel could not be built here (no C compiler?)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(args.slots, args.kv_heads, args.max_len, args.head_dim, generator=gen).transpose(2, 3).contiguous()
    v = torch.randn(args.slots, args.kv_heads, args.max_len, args.head_dim, generator=gen)
    cases = [(context, per_row) for context in map(int, args.contexts.split(","))
             for per_row in map(int, args.per_row.split(","))]
    return report_cases(
        args, f"{'context':>8}{'per row':>9}{'rows us/token':>15}{'interleaved':>13}{'ratio':>8}  same bits", cases,
        lambda context, per_row: measure(args, context, per_row, k, v),
        lambda r: (f"{r['context']:8d}{r['per_row']:9d}{r['rows_us_per_token']:15.2f}"
                   f"{r['interleaved_us_per_token']:13.2f}{r['interleaved_over_rows']:7.2f}x  {r['identical']}"))


if __name__ == "__main__":
    main()
