"""The plain engine of this tree against another commit's, rounds interleaved (REF, this, REF, ...).

    python -m benchmarks.bench_against REF [--dtypes float32,bfloat16] [--workloads bench,demo]
                                        [--rounds 3] [--out bench_results/against.json]

Each measurement is a fresh process in its tree (REF is extracted with `git archive`), one thread,
timing CPU seconds (time.process_time) of one plain rollout after a warm-up: "bench" is
benchmarks/bench.py's random 31.8M Llama (32 long-tail requests, batch 32), "demo" the demo's
warm-started policy (4 x 128, 32 prompts x 4 samples with stop tokens, batch 64). Prints tokens
per CPU-second (min and median over rounds) and this tree's ratio to REF, with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, dataclasses
import rollout
try:
    from rollout import cpu
    cpu.configure()
except ImportError:  # an older tree: importing rollout configured the process
    pass
import torch
from rollout import Engine, EngineConfig, SamplingParams
spec = json.loads(sys.argv[1])
torch.set_num_threads(1)
if spec["workload"] == "bench":
    from benchmarks.bench import bench_model, workload
    hf = bench_model(16000)
    prompts, lengths = workload(32, 16000, median=64, max_len=256)
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in lengths]
    batch, max_len = 32, 384
else:
    from rl_integration.config import PolicyConfig, TaskConfig
    from rl_integration.demo.policy import load_or_train_policy
    from rl_integration.demo.task import make_problems
    task = dataclasses.replace(TaskConfig(), num_problems=32, seed=77)
    hf, tok, _ = load_or_train_policy(task, PolicyConfig(), progress=False)
    prompts = [tok(p.prompt)["input_ids"] for p in make_problems(task) for _ in range(4)]
    params = [SamplingParams(temperature=1.0, max_tokens=256, stop_token_ids=[tok.eos_token_id])] * len(prompts)
    batch, max_len = 64, 512
eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=batch, max_model_len=max_len, dtype=spec["dtype"],
                                              num_threads=1))
eng.generate(prompts[:4], params[:4], seeds=[0, 1, 2, 3])
t0 = time.process_time()
outs = eng.generate(prompts, params, seeds=list(range(len(prompts))))
secs = time.process_time() - t0
print(json.dumps({"cpu_s": secs, "tokens": sum(len(o.token_ids) for o in outs),
                  "token_ids": [o.token_ids for o in outs]}))
"""


def measure(tree: Path, workload: str, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"workload": workload, "dtype": dtype})],
                          cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def extract(ref: str, into: Path) -> Path:
    tree = into / "ref"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def summarise(runs: dict, ref: str) -> list:
    rows = []
    for (workload, dtype), by_tree in runs.items():
        rate = {t: [r["tokens"] / r["cpu_s"] for r in rs] for t, rs in by_tree.items()}
        same = all(r["token_ids"] == by_tree[ref][0]["token_ids"] for rs in by_tree.values() for r in rs)
        row = {"workload": workload, "dtype": dtype, "tokens": by_tree["this"][0]["tokens"],
               "tokens_per_cpu_s": rate, "ratio_min": min(rate["this"]) / min(rate[ref]),
               "ratio_median": statistics.median(rate["this"]) / statistics.median(rate[ref]),
               "tokens_identical": same}
        rows.append(row)
        print(f"{workload:6} {dtype:9} {ref}: {min(rate[ref]):7.1f} / {statistics.median(rate[ref]):7.1f}  this: "
              f"{min(rate['this']):7.1f} / {statistics.median(rate['this']):7.1f} tokens per CPU-s (min / median); "
              f"this / {ref}: {row['ratio_min']:.3f}x (min) {row['ratio_median']:.3f}x (median); "
              f"tokens identical: {same}")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ref")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="bench,demo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_results/against.json")
    args = ap.parse_args(argv)
    load_before, runs = os.getloadavg(), {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {args.ref: extract(args.ref, Path(tmp)), "this": ROOT}
        for r in range(args.rounds):
            for workload in args.workloads.split(","):
                for dtype in args.dtypes.split(","):
                    for name, tree in trees.items():
                        res = measure(tree, workload, dtype)
                        runs.setdefault((workload, dtype), {}).setdefault(name, []).append(res)
                        print(f"round {r} {workload:6} {dtype:9} {name:>8}: {res['tokens'] / res['cpu_s']:7.1f} "
                              f"tokens per CPU-s", flush=True)
    report = {"note": "shared machine, one thread, CPU seconds", "ref": args.ref, "rounds": args.rounds,
              "load_average": {"before": load_before, "after": os.getloadavg()}, "results": summarise(runs, args.ref)}
    for row in report["results"]:
        for rs in runs[(row["workload"], row["dtype"])].values():
            for res in rs:
                res.pop("token_ids", None)
    report["runs"] = [{"workload": w, "dtype": d, "tree": t, **res} for (w, d), by in runs.items()
                      for t, rs in by.items() for res in rs]
    print(f"load average before {report['load_average']['before']}, after {report['load_average']['after']}")
    from benchmarks.bench import save_report
    return save_report(report, args.out)


if __name__ == "__main__":
    main()
