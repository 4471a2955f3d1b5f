"""One engine thread against two on the engine bench's workload, quiet and beside a CPU burner.

    python -m rollout.bench_loaded [--rounds 3] [--dtype float32] [--prompts 64] [--out FILE]

The issue this answers: on a loaded machine, are 2 threads ever slower than 1? Every run is a
fresh process (OpenMP reads its wait policy when torch loads) running rollout/profile.py's round
(random 31.8M Llama, long-tail forced lengths, batch 32, T=1) with 1 or 2 threads; "busy" runs
start a single-threaded CPU burner first (rollout/bench_threads.py's) and stop it after. Rounds
interleave 1t quiet, 2t quiet, 1t busy, 2t busy. Prints min / median tokens/s per setting, the
load average before and after each run, and last the ratios 2 threads / 1 thread, quiet and busy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .bench import save_report
from .bench_threads import _burner

SETTINGS = [(1, False), (2, False), (1, True), (2, True)]  # (threads, beside a burner)


def run(threads: int, dtype: str, prompts: int) -> dict:
    spec = {"dtype": dtype, "threads": threads, "prompts": prompts, "ops": False}
    done = subprocess.run([sys.executable, "-m", "rollout.profile", "--child", json.dumps(spec)],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"engine run failed:\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: res[k] for k in ("tokens_per_second", "tokens_per_cpu_second", "wall_seconds", "load_before",
                                "load_after", "tokens_hash")}


def measure(threads: int, busy: bool, dtype: str, prompts: int) -> dict:
    burner = _burner() if busy else None
    try:
        if burner is not None:
            time.sleep(0.5)  # let it take its core
        return run(threads, dtype, prompts)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="bench_results/threads_loaded.json")
    args = ap.parse_args(argv)
    runs: dict = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        for threads, busy in SETTINGS:
            res = measure(threads, busy, args.dtype, args.prompts)
            runs[(threads, busy)].append(res)
            print(f"round {r} {threads}t {'busy ' if busy else 'quiet'} {res['tokens_per_second']:7.1f} tok/s  "
                  f"load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}", flush=True)
    rows = [{"threads": t, "busy": b, "min": min(x["tokens_per_second"] for x in v),
             "median": statistics.median(x["tokens_per_second"] for x in v), "runs": v} for (t, b), v in runs.items()]
    by = {(row["threads"], row["busy"]): row for row in rows}
    print(f"\n{'threads':>7} {'setting':7} {'min':>8} {'median':>8}  tok/s")
    for row in rows:
        print(f"{row['threads']:>7} {'busy' if row['busy'] else 'quiet':7} {row['min']:8.1f} {row['median']:8.1f}")
    ratios = {("busy" if b else "quiet"): {"median": by[(2, b)]["median"] / by[(1, b)]["median"],
                                           "min": by[(2, b)]["min"] / by[(1, b)]["min"]} for b in (False, True)}
    same = len({x["tokens_hash"] for v in runs.values() for x in v}) == 1
    for name, ratio in ratios.items():
        print(f"2 threads / 1 thread, {name}: {ratio['median']:.2f}x (median), {ratio['min']:.2f}x (min)")
    print(f"tokens identical in every run: {same}")
    report = {"note": "shared machine: see each run's load average; compare ratios of interleaved rounds",
              "dtype": args.dtype, "prompts": args.prompts, "rounds": args.rounds, "results": rows,
              "ratio_2t_over_1t": ratios, "tokens_identical": same, "load_now": os.getloadavg()}
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
