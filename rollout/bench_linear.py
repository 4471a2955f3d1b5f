"""Small float32 linear layers: MKL's sgemm (torch's F.linear) against rollout/linear_kernel.c,
per weight shape and row count, interleaved (MKL, kernel, MKL, ...). Prints microseconds per
call (median over rounds) and MKL's time over the kernel's; writes JSON. Each row count also
checks that the kernel gives the first row the bits it has alone, and reports whether MKL does.

    python -m rollout.bench_linear [--shapes 128x128,...] [--rows 1,2,8,64,128,512] [--out ...]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from . import linear_kernel
from .bench import report_cases

DEMO_SHAPES = "128x128,64x128,256x128,128x256,102x128"  # (out x in) the demo policy's layers


def measure(library, args, out_features: int, in_features: int, rows: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = linear_kernel.pack(library, w)
    runs = {"mkl": lambda: F.linear(x, w, b),
            "kernel": lambda: linear_kernel.linear(library, packed, out_features, x, b)}
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                run()
            seconds[name].append((time.perf_counter() - start) / args.calls)
    alone = {"mkl": F.linear(x[:1], w, b), "kernel": linear_kernel.linear(library, packed, out_features, x[:1], b)}
    same = {name: bool(torch.equal(run()[:1], alone[name])) for name, run in runs.items()}
    result = {"shape": f"{out_features}x{in_features}", "rows": rows, "kernel_same_bits": same["kernel"],
              "mkl_same_bits": same["mkl"]}
    for name, s in seconds.items():
        result[f"{name}_us"] = 1e6 * statistics.median(s)
    result["mkl_over_kernel"] = statistics.median(a / c for a, c in zip(seconds["mkl"], seconds["kernel"]))
    result["kernel_gflops"] = 2e-3 * rows * in_features * out_features / result["kernel_us"]
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEMO_SHAPES, help="out x in, comma-separated")
    ap.add_argument("--rows", default="1,2,8,64,128,512")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=100, help="calls per timed round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_results/linear_kernel.json")
    args = ap.parse_args(argv)
    library = linear_kernel.load()
    if library is None:
        raise SystemExit("the linear kernel could not be built here (it needs a C compiler and AVX-512)")
    torch.set_num_threads(args.threads)
    cases = [(*map(int, shape.split("x")), rows) for shape in args.shapes.split(",")
             for rows in map(int, args.rows.split(","))]
    header = f"{'shape':>9}{'rows':>6}{'MKL us':>9}{'kernel us':>11}{'ratio':>8}{'GFLOP/s':>9}  same bits (kernel, MKL)"
    return report_cases(args, header, cases, functools.partial(measure, library, args), lambda r: (
        f"{r['shape']:>9}{r['rows']:6d}{r['mkl_us']:9.1f}{r['kernel_us']:11.1f}{r['mkl_over_kernel']:7.2f}x"
        f"{r['kernel_gflops']:9.1f}  {r['kernel_same_bits']}, {r['mkl_same_bits']}"))


if __name__ == "__main__":
    main()
