"""Does spectail's noise harm learning? The embedded GRPO run, three ways, over several seeds:

- plain: no speculation, no history; every epoch draws fresh noise (a sampling seed stream of
  its own, `rollout.seed` = 1000 + seed), as a trainer without spectail would;
- per_sample: spectail's default. A sample keeps its Gumbel noise across epochs, which is what
  lets last epoch's response draft this one's;
- per_epoch: spectail with fresh noise every epoch (the epoch enters the seed).

Every rollout is an exact sample of the current policy in all three; per_sample only
correlates a prompt's samples across epochs. The study shows whether that correlation changes
what GRPO learns. Each arm and seed is one `spectail train` run (same config, same epochs);
the mean reward per epoch goes into one JSON file and one plot.

    python -m rl_integration.noise_study --out bench_results/noise_study [--seeds 0 1 2] [--epochs 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from scheduler.atomic_file import atomic_write_text

from .plots import save_figure

ARMS = {
    "plain": lambda seed: ["rollout.spec=null", "rollout.history.enabled=false", "rollout.noise=per_epoch",
                           f"rollout.seed={1000 + seed}"],
    "per_sample": lambda seed: ["rollout.noise=per_sample"],
    "per_epoch": lambda seed: ["rollout.noise=per_epoch"],
}


def run_arm(arm: str, seed: int, epochs: int, out: str, overrides: Sequence[str]) -> list[dict]:
    from .config import load_config
    from .trainer import train

    cfg = load_config(None, list(overrides) + ARMS[arm](seed) + [
        f"trainer.seed={seed}", f"trainer.epochs={epochs}", f"output.dir={out}/{arm}-seed{seed}",
        "output.plot=false", "output.progress=false", "output.compare=false"])
    return train(cfg, echo=lambda line: None)


def summarize(results: dict) -> dict:
    """Per arm: the mean reward curve over seeds, and its last-epochs average per seed."""
    out = {}
    for arm, by_seed in results.items():
        curves = list(by_seed.values())
        tail = [statistics.mean(c[-3:]) for c in curves]
        out[arm] = {"mean_curve": [statistics.mean(v) for v in zip(*curves)],
                    "last3_per_seed": tail, "last3_mean": statistics.mean(tail),
                    "first_epoch_mean": statistics.mean(c[0] for c in curves)}
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for color, (arm, by_seed) in zip(("tab:gray", "tab:blue", "tab:orange"), results.items()):
        curves = list(by_seed.values())
        epochs = range(len(curves[0]))
        for c in curves:
            ax.plot(epochs, c, color=color, alpha=0.25, linewidth=1)
        ax.plot(epochs, [statistics.mean(v) for v in zip(*curves)], color=color, linewidth=2.5,
                marker="o", label=f"{arm} (mean of {len(curves)} seeds)")
    ax.set(xlabel="epoch", ylabel="mean reward", title="Embedded GRPO: reward by noise mode")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_integration.noise_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_results/noise_study", help="folder for the runs, JSON and plot")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides for every run")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    results: dict = {arm: {} for arm in args.arms}
    total = len(args.arms) * len(args.seeds)
    done = 0
    for seed in args.seeds:
        for arm in args.arms:
            start = time.perf_counter()
            records = run_arm(arm, seed, args.epochs, args.out, args.overrides)
            results[arm][seed] = [r["reward_mean"] for r in records]
            done += 1
            print(f"[{done}/{total}] {arm:10s} seed {seed}: reward {results[arm][seed][0]:.3f} -> "
                  f"{results[arm][seed][-1]:.3f} ({time.perf_counter() - start:.0f}s)", flush=True)
    summary = summarize(results)
    report = {"epochs": args.epochs, "seeds": args.seeds, "overrides": args.overrides,
              "rewards": {arm: {str(s): c for s, c in by_seed.items()} for arm, by_seed in results.items()},
              "summary": summary}
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "noise_study.json"), json.dumps(report, indent=1))
    plot(results, os.path.join(args.out, "noise_study.png"))
    for arm, s in summary.items():
        print(f"{arm:10s} first epoch {s['first_epoch_mean']:.3f}  last 3 epochs {s['last3_mean']:.3f} "
              f"(per seed {', '.join(f'{x:.3f}' for x in s['last3_per_seed'])})")
    print(f"wrote {args.out}/noise_study.json and {args.out}/noise_study.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
