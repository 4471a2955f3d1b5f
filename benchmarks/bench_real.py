"""The benchmark of record: GRPO steps on the real workload, plain against speculation.

    python -m benchmarks.bench_real [--steps 4] [--dtypes float32,bfloat16] [--out bench_results/real]

The workload is examples/grpo_real.yaml: SmolLM2-135M-Instruct (`spectail fetch smollm2`) on a
reasoning-gym task, GRPO groups of 8, 16 prompts a step, responses up to 256 tokens at T=1, fresh
noise every step, a data set small enough that prompts come back every few steps (history
drafts count). At each step the same prompts, seeds and weights run through three rollout
clients, in alternating order (A B C, then C B A):

    plain     no speculation
    default   the run config's proposers (history, suffix, lookahead)
    drafter   the same plus the online draft head (trained between steps)

One GRPO update per step is made from the default client's batch (every client samples the same
tokens: checked) and pushed to all three. Per step and client it records rollout seconds, tail
seconds (90% of samples done to the last), target forwards, tokens fed per emitted token,
acceptance per proposer and per draft position, the head's share of the rollout, and whether the
tokens equal plain's. It writes JSON and a plot, and its last line gives the median rollout
speedup over plain from step 1 and whether the tokens were identical everywhere.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import tempfile
import time

VARIANTS = ("plain", "default", "drafter")
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "grpo_real.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG, help="the run config (default: examples/grpo_real.yaml)")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per dtype (speedups are read from step 1)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"which of {VARIANTS} to run")
    p.add_argument("--out", default="bench_results/real", help="folder for bench_real.json and bench_real.png")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads of every engine (the same for all: an engine's own choice is timed at start)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    return p.parse_args(argv)


def load_run(args, dtype: str):
    """(cfg, model, tokenizer, policy folder, problems, prompts, reward) of the real workload at an
    engine dtype."""
    from rl_integration.config import load_config
    from rl_integration.dataset import encode_prompts
    from rl_integration.trainer import load_policy, load_problems, resolve_reward

    overrides = list(args.overrides) + [f"rollout.engine.dtype={dtype}", f"rollout.engine.num_threads={args.threads}",
                                        "output.progress=false"]
    cfg = load_config(args.config, overrides)
    model, tokenizer, policy_folder = load_policy(cfg, progress=False)
    problems = load_problems(cfg)
    prompts = encode_prompts(tokenizer, problems, cfg.policy.chat_template)
    return cfg, model, tokenizer, policy_folder, problems, prompts, resolve_reward(cfg.task)


def make_clients(cfg, model, tokenizer, variants, folder: str, policy_folder: str, prompts) -> tuple[dict, object]:
    """One RolloutClient per variant (each with its own history), and the drafter's state (its
    head warm-started on the task's prompts, as `spectail train` starts it)."""
    from rl_integration import online_drafter
    from rl_integration.rollout_client import RolloutClient

    eos = [tokenizer.eos_token_id]
    clients, drafter = {}, None
    for name in variants:
        c = copy.deepcopy(cfg)
        c.output.dir = os.path.join(folder, name)
        if name == "drafter":
            c.rollout.drafter = dataclasses.replace(c.rollout.drafter, enabled=True)
            drafter = online_drafter.start(c, policy_folder, False, prompts, eos)
        clients[name] = RolloutClient(c, model, stop_token_ids=eos, plain=name == "plain",
                                      history_dir=os.path.join(folder, name, "history"))
        warm_up(clients[name].backend.engine)
    return clients, drafter


def warm_up(engine) -> None:
    """One short run, untimed: an engine's one-time costs (the step-cost profile of a new machine,
    lazy set-up) are its start's, not a rollout's."""
    from rollout import SamplingParams

    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), seeds=[0])


def variant_record(batch, extra: dict) -> dict:
    """The figures of one client's rollout of one step."""
    s = batch.step_stats
    proposed, accepted = s.get("proposed", {}), s.get("accepted", {})
    tokens = s["generated_tokens"]
    rec = {"rollout_seconds": s["rollout_seconds"], "tail_seconds": s["tail_seconds"],
           "target_forwards": s["engine_steps"], "generated_tokens": tokens,
           "fed_per_emitted": s.get("fed_tokens", 0) / tokens if tokens else None,
           "tokens_per_forward": s["accepted_per_verify"],
           "acceptance": {k: accepted.get(k, 0) / v for k, v in proposed.items() if v},
           "acceptance_by_position": s.get("acceptance_by_position"),
           "proposed": proposed, "accepted": accepted}
    rec.update(extra)
    return rec


def run_dtype(args, dtype: str, variants) -> list[dict]:
    from rl_integration import online_drafter
    from rl_integration.trainer import compare_tokens, compute_rewards, make_trainer

    cfg, model, tokenizer, policy_folder, problems, prompts, reward = load_run(args, dtype)
    tr = cfg.trainer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = make_trainer(cfg, model, pad)
    steps = []
    with tempfile.TemporaryDirectory(prefix="bench-real-") as folder:
        clients, drafter = make_clients(cfg, model, tokenizer, variants, folder, policy_folder, prompts)
        try:
            for step in range(args.steps):
                start = step * tr.prompts_per_step
                idx = [(start + j) % len(problems) for j in range(tr.prompts_per_step)]
                order = list(variants) if step % 2 == 0 else list(reversed(variants))
                batches = {name: clients[name].generate([prompts[i] for i in idx], step=step) for name in order}
                main = batches["default"] if "default" in batches else batches[order[0]]
                rewards = compute_rewards(reward, tokenizer, main, [problems[i] for i in idx])
                record = {"step": step, "dtype": dtype, "order": order, "reward_mean": statistics.fmean(rewards)}
                for name, batch in batches.items():
                    clients[name].record_rewards(batch, rewards)
                    extra = {}
                    if name == "drafter":
                        extra = online_drafter.after_rollout(drafter, clients[name], batch, rewards)
                    if "plain" in batches and name != "plain":
                        extra["tokens_identical"] = not compare_tokens(batch, batches["plain"])
                    record[name] = variant_record(batch, extra)
                t0 = time.perf_counter()
                record["train"] = trainer.step(main, rewards)
                record["train_seconds"] = time.perf_counter() - t0
                for name, client in clients.items():
                    client.update_weights(model)
                    if name == "drafter":
                        record[name].update(online_drafter.between_steps(drafter, client))
                    client.end_step()
                steps.append(record)
                print(row(record, variants), flush=True)
        finally:
            for client in clients.values():
                client.shutdown()
    return steps


def row(rec: dict, variants) -> str:
    plain = rec.get("plain", {}).get("rollout_seconds")
    cells = [f"{rec['dtype']:>8} step {rec['step']}", f"reward {rec['reward_mean']:.3f}"]
    for name in variants:
        v = rec[name]
        ratio = f" {plain / v['rollout_seconds']:.2f}x" if plain and name != "plain" else ""
        same = "" if "tokens_identical" not in v else (" same" if v["tokens_identical"] else " DIFFER")
        cells.append(f"{name} {v['rollout_seconds']:.1f}s{ratio} tail {v['tail_seconds']:.1f}s "
                     f"fwd {v['target_forwards']} tok/fwd {v['tokens_per_forward']:.2f}{same}")
    return " | ".join(cells)


def summary(steps: list[dict], variants) -> dict:
    """Median speedup over plain from step 1 (or step 0 when only one step ran), per dtype and variant."""
    out = {}
    for dtype in sorted({s["dtype"] for s in steps}):
        mine = [s for s in steps if s["dtype"] == dtype]
        later = [s for s in mine if s["step"] >= 1] or mine
        for name in variants:
            if name == "plain" or "plain" not in variants:
                continue
            ratios = [s["plain"]["rollout_seconds"] / s[name]["rollout_seconds"] for s in later]
            tail = [s["plain"]["tail_seconds"] / s[name]["tail_seconds"] for s in later if s[name]["tail_seconds"]]
            out[f"{dtype}/{name}"] = {
                "median_speedup_from_step_1": statistics.median(ratios), "min_speedup": min(ratios),
                "step0_speedup": mine[0]["plain"]["rollout_seconds"] / mine[0][name]["rollout_seconds"],
                "median_tail_speedup": statistics.median(tail) if tail else None,
                "tokens_identical": all(s[name].get("tokens_identical", True) for s in mine)}
    return out


def plot(steps: list[dict], variants, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({s["dtype"] for s in steps})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 3.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        mine = [s for s in steps if s["dtype"] == dtype]
        for name in variants:
            ax.plot([s["step"] for s in mine], [s[name]["rollout_seconds"] for s in mine], marker="o", label=name)
        ax.set_title(f"SmolLM2-135M, {dtype}")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("rollout seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    load = os.getloadavg()
    steps = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        steps.extend(run_dtype(args, dtype, variants))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "load_before": load, "load_after": os.getloadavg(), "config": args.config,
              "overrides": args.overrides, "steps": steps, "summary": summary(steps, variants)}
    with open(os.path.join(args.out, "bench_real.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plot(steps, variants, os.path.join(args.out, "bench_real.png"))
    identical = all(v["tokens_identical"] for v in result["summary"].values())
    for key, v in result["summary"].items():
        print(f"{key}: median rollout speedup over plain from step 1 {v['median_speedup_from_step_1']:.2f}x "
              f"(min {v['min_speedup']:.2f}x, step 0 {v['step0_speedup']:.2f}x)")
    medians = ", ".join(f"{k} {v['median_speedup_from_step_1']:.2f}x" for k, v in result["summary"].items())
    print(f"median rollout speedup over plain from step 1: {medians}; tokens identical: "
          f"{'yes' if identical else 'NO'}")
    return result


def machine() -> str:
    import platform

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
