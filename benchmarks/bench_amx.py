"""bfloat16 linear layers: oneDNN (packed weight, the engine's former route) against
rollout/kernels/amx_kernel.c, per weight shape and row count, interleaved (oneDNN, kernel, oneDNN, ...).
Prints microseconds per call (median over rounds) and oneDNN's time over the kernel's; writes
JSON. Each case also checks whether each gives the first row the bits it has in a call of two.

spectail caps oneDNN below AMX (rollout/kernels/cpu_isa.py), so by default oneDNN runs AVX-512 BF16 here;
to race oneDNN's own AMX kernels (what vLLM runs), lift the cap for this process:

    ONEDNN_MAX_CPU_ISA=ALL python -m benchmarks.bench_amx [--shapes 512x512,...] [--rows 1,8,32,128,512]
"""
from __future__ import annotations

import functools

import torch

from benchmarks.bench_linear import compared, parser, run_cases
from rollout.kernels import amx_linear, cpu_isa

# (out x in) the random Llama of `python -m benchmarks.bench` (q, k/v, gate/up, down, lm_head), a wide layer
SHAPES = "512x512,256x512,1408x512,512x1408,16000x512,896x4864"


def measure(library, args, out_features: int, in_features: int, rows: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = amx_linear.pack(library, w)
    onednn = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    calls = {"onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
             "kernel": lambda x: amx_linear.linear(library, packed, out_features, x, None)}
    pair = torch.cat([x[:1], x[:1]])  # the first row in a call of two (one-row calls: rollout/kernels/linear.py)
    same = {name: bool(torch.equal(call(x)[:1], call(pair)[:1])) for name, call in calls.items()}
    runs = {name: functools.partial(call, x) for name, call in calls.items()}
    return compared(args, "onednn", runs, same, out_features, in_features, rows)


def main(argv=None) -> dict:
    args = parser(__doc__, SHAPES, "1,8,32,128,512", 5, 50, "bench_results/amx_kernel.json").parse_args(argv)
    library = amx_linear.load()
    if library is None:
        raise SystemExit("the AMX kernel is not usable here (it needs a CPU with AMX-BF16, Linux and a C compiler)")
    args.onednn_on_amx = not cpu_isa.rows_invariant()
    print(f"oneDNN {'on AMX' if args.onednn_on_amx else 'capped below AMX (ONEDNN_MAX_CPU_ISA=ALL to lift it)'}")
    return run_cases(args, functools.partial(measure, library, args), "onednn", "oneDNN")


if __name__ == "__main__":
    main()
