"""Does spectail's noise harm learning? The embedded GRPO run, three ways, over several seeds:

- plain: no speculation, no history; every step draws fresh noise (a sampling seed stream of
  its own, `rollout.seed` = 1000 + seed), as a trainer without spectail would;
- per_sample: spectail with a sample keeping its Gumbel noise across steps, which lets the
  previous step's response draft this one's for long runs;
- per_step: spectail with fresh noise every step (the step enters the seed; the default).

(A step is one rollout plus its updates. The demo's data set is one step's prompts, so every
step is also an epoch, a pass over the data set.)

Speculation never changes a token, so the only question is the noise. Under per_step every
rollout is an exact sample of the current policy. Under per_sample the noise is the same one the
weights were trained on, so given the weights it is no longer fresh. The study shows whether
that changes what GRPO learns (it does: see the README). Each arm and seed is one `spectail train`
run (same config, same steps).

Two rewards per step go into one JSON file and one plot. The training reward is the mean
over the step's rollout, the curve a trainer watches. Under per_sample noise it is measured on
the same noise every step, so it also counts what the policy learnt about those particular
draws. The evaluation reward is the policy after the step's update, sampled with noise that
no arm trains on: a seed stream of its own (EVAL_SEED), the same for every arm, seed and
step, n samples of every prompt, plain engine.

    python -m benchmarks.noise_study --out bench_results/noise_study [--seeds 0 1 2] [--steps 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Optional, Sequence

from rl_integration.plots import save_figure
from scheduler.atomic_file import atomic_write_text

EVAL_SEED = 777_777
ARMS = {
    "plain": lambda seed: ["rollout.engine.spec=null", "rollout.history.enabled=false", "rollout.noise=per_step",
                           f"rollout.seed={1000 + seed}"],
    "per_sample": lambda seed: ["rollout.noise=per_sample"],
    "per_step": lambda seed: ["rollout.noise=per_step"],
}


class FreshNoiseEval:
    """on_step_end hook: the policy's mean reward on every problem of the run's data set,
    n samples each, drawn with the EVAL_SEED stream by the plain engine."""

    def __init__(self, cfg):
        from rl_integration.config import plain_engine
        from rl_integration.dataset import encode_prompts
        from rl_integration.rollout_client import RolloutClient
        from rl_integration.trainer import load_policy, load_problems, resolve_reward

        self.cfg = cfg
        self.problems = load_problems(cfg)
        model, self.tokenizer, _ = load_policy(cfg, progress=False)
        self.prompts = encode_prompts(self.tokenizer, self.problems, cfg.policy.chat_template)
        self.reward = resolve_reward(cfg.task)
        eos = self.tokenizer.eos_token_id
        rollout = dataclasses.replace(cfg.rollout, engine=plain_engine(cfg.rollout), noise="per_sample")
        self.client = RolloutClient(rollout, model, seed=EVAL_SEED, stop_token_ids=[] if eos is None else [eos],
                                    plain=True)

    def __call__(self, step: int, model) -> dict:
        from rl_integration.trainer import compute_rewards

        self.client.update_weights(model)
        batch = self.client.generate(self.prompts)
        rewards = compute_rewards(self.reward, self.tokenizer, batch, self.problems)
        return {"eval_reward": statistics.mean(rewards)}

    def close(self) -> None:
        self.client.shutdown()


def run_arm(arm: str, seed: int, steps: int, out: str, overrides: Sequence[str]) -> list[dict]:
    from rl_integration.config import load_config
    from rl_integration.trainer import train

    cfg = load_config(None, list(overrides) + ARMS[arm](seed) + [
        f"trainer.seed={seed}", f"trainer.steps={steps}", f"output.dir={out}/{arm}-seed{seed}",
        "output.plot=false", "output.progress=false", "output.compare=false"])
    evaluate = FreshNoiseEval(cfg)
    try:
        return train(cfg, echo=lambda line: None, on_step_end=evaluate)
    finally:
        evaluate.close()


def summarize(results: dict) -> dict:
    """Per arm: the mean curve over seeds, the last 3 steps' average per seed and overall,
    and the first step's mean."""
    out = {}
    for arm, by_seed in results.items():
        curves = list(by_seed.values())
        tail = [statistics.mean(c[-3:]) for c in curves]
        out[arm] = {"mean_curve": [statistics.mean(v) for v in zip(*curves)],
                    "last3_per_seed": tail, "last3_mean": statistics.mean(tail),
                    "first_step_mean": statistics.mean(c[0] for c in curves)}
    return out


def plot(curves: dict, path: str) -> None:
    """curves: {panel title: {arm: {seed: [value per step]}}}, one panel each."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6.5 * len(curves), 4), squeeze=False)
    for ax, (title, results) in zip(axes[0], curves.items()):
        for color, (arm, by_seed) in zip(("tab:gray", "tab:blue", "tab:orange"), results.items()):
            runs = list(by_seed.values())
            steps = range(len(runs[0]))
            for c in runs:
                ax.plot(steps, c, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, [statistics.mean(v) for v in zip(*runs)], color=color, linewidth=2.5,
                    marker="o", label=f"{arm} (mean of {len(runs)} seeds)")
        ax.set(xlabel="step", ylabel="mean reward", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.noise_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_results/noise_study", help="folder for the runs, JSON and plot")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides for every run")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    train_r: dict = {arm: {} for arm in args.arms}
    eval_r: dict = {arm: {} for arm in args.arms}
    total = len(args.arms) * len(args.seeds)
    done = 0
    for seed in args.seeds:
        for arm in args.arms:
            start = time.perf_counter()
            records = run_arm(arm, seed, args.steps, args.out, args.overrides)
            train_r[arm][seed] = [r["reward_mean"] for r in records]
            eval_r[arm][seed] = [r["eval_reward"] for r in records]
            done += 1
            print(f"[{done}/{total}] {arm:10s} seed {seed}: training reward {train_r[arm][seed][0]:.3f} -> "
                  f"{train_r[arm][seed][-1]:.3f}, evaluation {eval_r[arm][seed][0]:.3f} -> {eval_r[arm][seed][-1]:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    report = {"steps": args.steps, "seeds": args.seeds, "overrides": args.overrides, "eval_seed": EVAL_SEED}
    for name, res in (("training_reward", train_r), ("eval_reward", eval_r)):
        report[name] = {arm: {str(s): c for s, c in by_seed.items()} for arm, by_seed in res.items()}
        report[name + "_summary"] = summarize(res)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "noise_study.json"), json.dumps(report, indent=1))
    plot({"training reward (the step's rollout)": train_r,
          "evaluation reward (fresh noise, after the step's update)": eval_r},
         os.path.join(args.out, "noise_study.png"))
    for name in ("training_reward", "eval_reward"):
        print(name)
        for arm, s in report[name + "_summary"].items():
            print(f"  {arm:10s} first step {s['first_step_mean']:.3f}  last 3 steps {s['last3_mean']:.3f} "
                  f"(per seed {', '.join(f'{x:.3f}' for x in s['last3_per_seed'])})")
    print(f"wrote {args.out}/noise_study.json and {args.out}/noise_study.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
