"""Small float32 linear layers: MKL's sgemm (torch's F.linear) against rollout/kernels/linear_kernel.c,
per weight shape and row count, interleaved (MKL, kernel, MKL, ...). Prints microseconds per
call (median over rounds) and MKL's time over the kernel's; writes JSON. Each row count also
checks that the kernel gives the first row the bits it has alone, and reports whether MKL does.

    python -m benchmarks.bench_linear [--shapes 128x128,...] [--rows 1,2,8,64,128,512] [--out ...]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.bench import report_cases
from rollout.kernels import linear_kernel

DEMO_SHAPES = "128x128,64x128,256x128,128x256,102x128"  # (out x in) the demo policy's layers


def race(runs: dict, rounds: int, calls: int) -> dict:
    """name -> seconds per call of runs[name]() in each round, the runs interleaved."""
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            seconds[name].append((time.perf_counter() - start) / calls)
    return seconds


def compared(args, peer: str, runs: dict, same: dict, out_features: int, in_features: int, rows: int) -> dict:
    """One case's record: the peer's and the kernel's microseconds per call (median over rounds),
    the peer's time over the kernel's (median of per-round ratios), the kernel's GFLOP/s, and
    whether each gave a row the bits it has in a call of its own (`same`)."""
    seconds = race(runs, args.rounds, args.calls)
    result = {"shape": f"{out_features}x{in_features}", "rows": rows, "kernel_same_bits": same["kernel"],
              f"{peer}_same_bits": same[peer]}
    for name, s in seconds.items():
        result[f"{name}_us"] = 1e6 * statistics.median(s)
    result[f"{peer}_over_kernel"] = statistics.median(a / c for a, c in zip(seconds[peer], seconds["kernel"]))
    result["kernel_gflops"] = 2e-3 * rows * in_features * out_features / result["kernel_us"]
    return result


def measure(library, args, out_features: int, in_features: int, rows: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = linear_kernel.pack(library, w)
    runs = {"mkl": lambda: F.linear(x, w, b),
            "kernel": lambda: linear_kernel.linear(library, packed, out_features, x, b)}
    alone = {"mkl": F.linear(x[:1], w, b), "kernel": linear_kernel.linear(library, packed, out_features, x[:1], b)}
    same = {name: bool(torch.equal(run()[:1], alone[name])) for name, run in runs.items()}
    return compared(args, "mkl", runs, same, out_features, in_features, rows)


def parser(doc: str, shapes: str, rows: str, rounds: int, calls: int, out: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=shapes, help="out x in, comma-separated")
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--calls", type=int, default=calls, help="calls per timed round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=out)
    return ap


def run_cases(args, measure, peer: str, label: str) -> dict:
    """measure(out_features, in_features, rows) for every shape and row count of args, printed as a
    table of the peer (named `label`) against the kernel and written as JSON."""
    torch.set_num_threads(args.threads)
    cases = [(*map(int, shape.split("x")), rows) for shape in args.shapes.split(",")
             for rows in map(int, args.rows.split(","))]
    header = (f"{'shape':>10}{'rows':>6}{label + ' us':>12}{'kernel us':>11}{'ratio':>8}{'GFLOP/s':>9}"
              f"  same bits (kernel, {label})")
    return report_cases(args, header, cases, measure, lambda r: (
        f"{r['shape']:>10}{r['rows']:6d}{r[peer + '_us']:12.1f}{r['kernel_us']:11.1f}{r[peer + '_over_kernel']:7.2f}x"
        f"{r['kernel_gflops']:9.1f}  {r['kernel_same_bits']}, {r[peer + '_same_bits']}"))


def main(argv=None) -> dict:
    args = parser(__doc__, DEMO_SHAPES, "1,2,8,64,128,512", 9, 100, "bench_results/linear_kernel.json").parse_args(argv)
    library = linear_kernel.load()
    if library is None:
        raise SystemExit("the linear kernel could not be built here (it needs a C compiler and AVX-512)")
    return run_cases(args, functools.partial(measure, library, args), "mkl", "MKL")


if __name__ == "__main__":
    main()
