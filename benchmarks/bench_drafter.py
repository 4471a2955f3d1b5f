"""Drafter benchmarks on the demo's policy.

    python -m benchmarks.bench_drafter            the drafter in the engine (A/B/C/D, step 0 and step 1):
                                                  benchmarks/bench_drafter_engine.py, bench_results/drafter_engine.json
    python -m benchmarks.bench_drafter --choice   which proposer's drafts win with and without the drafter:
                                                  benchmarks/bench_drafter_choice.py, bench_results/drafter_choice.json
    python -m benchmarks.bench_drafter --ray      training on idle Ray workers off / on:
                                                  benchmarks/bench_drafter_ray.py
    python -m benchmarks.bench_drafter --offline [--prompts 64] [--samples 8] [--train-seconds 120] [--train-steps N]
                            [--kinds attention,mlp] [--shapes 256:4:2,128:2:1] [--window 64]
                            [--out bench_results/drafter_offline.json]

The offline benchmark:

1. Samples a training rollout (prompts x samples at T = 1, step-0 seeds) with spectail's Engine
   from the demo's warm-started policy (trained on first use, then cached under ~/.cache/spectail).
2. Warm-starts a head of each kind on it (drafter.warm_start) within the training budget.
3. Samples a fresh rollout (the same prompts, step-1 seeds; and new prompts) and measures the
   exact simulated acceptance of each head on it (drafter.simulate), k = 1..8.
4. Times one draft position of the head for a batch of 64 requests (a batched head forward plus
   the coupled sample, as drafter.draft runs it) against one engine decode step of the policy at
   batch 64 (its forward plus the coupled sample), interleaved, one thread as the engine uses here.
The demo's modules are imported here only (rl_integration sits above drafter).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

import torch

from benchmarks.bench import save_report
from drafter.draft import Chain, draft_chains
from drafter.features import SavedRollout
from drafter.head import HeadConfig
from drafter.simulate import simulated_acceptance
from drafter.trainer import TrainConfig
from drafter.warm_start import warm_start
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core import sampling, threads
from rollout.core.batch import ForwardBatch
from rollout.core.seeds import prompt_key, sample_seed

RUN_SEED = 20240


def demo_policy():
    """(hf model, tokenizer, folder, make_problems, TaskConfig) of the embedded demo, wherever the
    renovation has put its modules."""
    try:
        from rl_integration.demo.policy import PolicyConfig, load_or_train_policy
        from rl_integration.demo.task import TaskConfig, make_problems
    except ImportError:
        from rl_integration.policy import PolicyConfig, load_or_train_policy
        from rl_integration.task import TaskConfig, make_problems
    model, tok, folder = load_or_train_policy(TaskConfig(), PolicyConfig())
    return model, tok, folder, make_problems, TaskConfig


def sample_rollouts(engine: Engine, prompts: list[list[int]], samples: int, step: int, eos: int) -> list[SavedRollout]:
    params = SamplingParams(temperature=1.0, max_tokens=512, stop_token_ids=[eos])
    ids, seeds, groups = [], [], []
    for g, p in enumerate(prompts):
        for i in range(samples):
            ids.append(p)
            seeds.append(sample_seed(RUN_SEED, prompt_key(p), i, step))
            groups.append(g)
    outs = engine.generate(ids, params, seeds=seeds, groups=groups)
    return [SavedRollout(p, o.token_ids, o.seed, 1.0, 0, 1.0) for p, o in zip(ids, outs)]


def time_steps(policy, head, batch: int, ctx: int, reps: int) -> dict:
    """One head draft position (drafter.draft.draft_chains with one new row and k = 1 per request:
    the batched head forward and the coupled sample) vs one engine decode step (policy forward and
    coupled sample), both at `batch` requests with `ctx` tokens of context, interleaved; seconds
    (min, median). A verify step with 4 drafts per request is timed too, for reference."""
    device = policy.lm_head.weight.device
    cache, head_cache = policy.new_cache(batch, ctx + 8), head.new_cache(batch, ctx + 8, max_draft=8)
    rows = [(i, ctx, [5 + i % 50]) for i in range(batch)]
    verify_rows = [(i, ctx, [5 + i % 50] * 5) for i in range(batch)]
    seeds = torch.arange(batch, dtype=torch.int64)
    temp, top_k, top_p = (torch.ones(batch), torch.zeros(batch, dtype=torch.int64), torch.ones(batch))
    feats = torch.randn(batch, policy.cfg.hidden_size, dtype=policy.lm_head.weight.dtype, device=device)
    chains = [Chain(i, ctx, [5 + i % 50], feats[i:i + 1], int(seeds[i]), ctx, 1) for i in range(batch)]
    chains8 = [Chain(i, ctx, [5 + i % 50], feats[i:i + 1], int(seeds[i]), ctx, 8) for i in range(batch)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def engine_step():
        logits, _ = policy(ForwardBatch.build(rows, list(range(batch)), device), cache)
        sampling.sample(logits, seeds, torch.full((batch,), ctx), temp, top_k, top_p)
        sync()

    def verify_step():  # for reference: every row carries 4 draft tokens
        n = 5 * batch
        logits, _ = policy(ForwardBatch.build(verify_rows, list(range(n)), device), cache)
        sampling.sample(logits, seeds.repeat(5), torch.full((n,), ctx), temp.repeat(5), top_k.repeat(5),
                        top_p.repeat(5))
        sync()

    def head_step():
        draft_chains(head, policy, head_cache, chains, margins=True)
        sync()

    def head_chain8():  # eight positions per call: the cost of a position within a chain
        draft_chains(head, policy, head_cache, chains8, margins=True)
        sync()

    times = {"engine_step": [], "head_step": [], "engine_verify_step": [], "head_chain8": []}
    steps = (("engine_step", engine_step), ("head_step", head_step), ("engine_verify_step", verify_step),
             ("head_chain8", head_chain8))
    with threads.using(1):
        for _ in range(3):
            for _, fn in steps:
                fn()
        for _ in range(reps):
            for name, fn in steps:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    out = {k: {"min_s": min(v), "median_s": statistics.median(v)} for k, v in times.items()}
    out["ratio_median"] = out["head_step"]["median_s"] / out["engine_step"]["median_s"]
    out["ratio_min"] = out["head_step"]["min_s"] / out["engine_step"]["min_s"]
    out["position_in_chain_ratio_median"] = out["head_chain8"]["median_s"] / 8 / out["engine_step"]["median_s"]
    out["position_in_chain_ratio_min"] = out["head_chain8"]["min_s"] / 8 / out["engine_step"]["min_s"]
    out.update(batch=batch, context=ctx, reps=reps)
    return out


def parse_shapes(text: Optional[str], args) -> list[dict]:
    """"ffn:heads:kv_heads,..." (an empty field: the policy's) -> HeadConfig keyword sets; None:
    the one shape of --intermediate / --heads / --kv-heads."""
    if not text:
        return [dict(intermediate_size=args.intermediate, num_heads=args.heads, num_kv_heads=args.kv_heads)]
    shapes = []
    for part in text.split(","):
        fields = part.split(":")
        if len(fields) != 3 or not all(f == "" or f.isdigit() for f in fields):
            raise ValueError(f"--shapes: {part!r} is not ffn:heads:kv_heads (integers, empty for the policy's)")
        shapes.append({k: int(f) if f else None for k, f in zip(("intermediate_size", "num_heads", "num_kv_heads"),
                                                                 fields)})
    return shapes


def shape_name(shape: dict) -> str:
    return ":".join("" if shape[k] is None else str(shape[k]) for k in ("intermediate_size", "num_heads",
                                                                          "num_kv_heads"))


def offline(args) -> dict:
    from rollout.core.model import CausalLM

    t0 = time.perf_counter()
    _, tok, folder, make_problems, TaskConfig = demo_policy()
    policy = CausalLM.from_pretrained(folder)
    eos = tok.eos_token_id
    prompts = [tok(p.prompt)["input_ids"] for p in make_problems(TaskConfig(num_problems=args.prompts, seed=0))]
    fresh_prompts = [tok(p.prompt)["input_ids"] for p in make_problems(TaskConfig(num_problems=args.prompts, seed=1))]
    engine = Engine(policy, EngineConfig(max_batch_size=64, max_model_len=1024,
                                         spec=SpecConfig(proposers=("suffix",), max_draft_tokens=8)))
    t1 = time.perf_counter()
    train_rolls = sample_rollouts(engine, prompts, args.samples, 0, eos)
    test_rolls = sample_rollouts(engine, prompts, args.samples, 1, eos)
    fresh_rolls = sample_rollouts(engine, fresh_prompts, 1, 1, eos)
    rollout_s = time.perf_counter() - t1
    lengths = sorted(len(r.response_ids) for r in train_rolls)
    result = {"policy": folder, "prompts": args.prompts, "samples": args.samples, "rollout_seconds": rollout_s,
              "train_tokens": sum(len(r.token_ids) for r in train_rolls),
              "response_len": {"median": lengths[len(lengths) // 2], "max": lengths[-1]}, "heads": {}}
    for kind, shape in [(k, s) for k in args.kinds for s in args.shapes]:
        name = kind if len(args.shapes) == 1 else f"{kind}-{shape_name(shape)}"
        head, _, report = warm_start(policy, train_rolls, HeadConfig(kind=kind, window=args.window, **shape),
                                     TrainConfig(decay="cosine", num_threads=args.threads),
                                     time_budget_s=args.train_seconds, max_steps=args.train_steps)
        head.eval()
        entry = {"parameters": head.num_parameters(), "train": report,
                 "same_prompts_new_seeds": simulated_acceptance(head, policy, test_rolls),
                 "new_prompts": simulated_acceptance(head, policy, fresh_rolls),
                 "cost": time_steps(policy, head, 64, args.ctx, args.reps)}
        result["heads"][name] = entry
        sim = entry["same_prompts_new_seeds"]
        print(f"{name:9s} params {entry['parameters']:>8d}  "
              f"trained {report['steps']} steps in {report['seconds']:.1f}s  "
              f"per-token acceptance {sim['per_token_acceptance']:.3f} (first {sim['first_token_acceptance']:.3f}), "
              f"tokens/forward at k=8 {sim['by_k'][8]['tokens_per_forward']:.2f}; new prompts "
              f"{entry['new_prompts']['per_token_acceptance']:.3f}; head step / engine step "
              f"{entry['cost']['ratio_median']:.3f} (median), {entry['cost']['ratio_min']:.3f} (min)", flush=True)
    result.update(total_seconds=time.perf_counter() - t0, loadavg=os.getloadavg(),
                  note="shared 2-core machine; ratios measured interleaved in one run")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--offline", action="store_true", help="the offline benchmark (warm start, simulation)")
    ap.add_argument("--ray", action="store_true", help="the Ray spot trainer's benchmark")
    ap.add_argument("--choice", action="store_true", help="which proposer's drafts win in B and D, step 0 and 1 "
                    "(benchmarks/bench_drafter_choice.py)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved runs per engine (engine mode; default 2) "
                    "or timed repetitions of the head's step (offline; default 30)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--train-seconds", type=float, default=120.0)
    ap.add_argument("--train-steps", type=int, default=None, help="stop training after this many steps")
    ap.add_argument("--kinds", default="attention,mlp")
    ap.add_argument("--window", type=int, default=None, help="the attention head's window (default: none)")
    ap.add_argument("--intermediate", type=int, default=None, help="the head's feed-forward size")
    ap.add_argument("--heads", type=int, default=None, help="the head's attention heads (default: the policy's)")
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=None)
    ap.add_argument("--layer", default=None, help="engine mode: the warm-started head's layer, 'ffn:heads:kv_heads' "
                    "(default: rollout.drafter's)")
    ap.add_argument("--shapes", default=None, help="offline: several head shapes on the same rollouts, "
                    "'ffn:heads:kv_heads,...' (an empty field: the policy's), instead of the three above")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while training (default 1)")
    ap.add_argument("--ctx", type=int, default=128, help="context length of the timed steps")
    ap.add_argument("--device", default="cpu", help="engine mode: the policy's, the head's and the engines' device")
    ap.add_argument("--train-seconds-between", dest="between", type=float, default=5.0,
                    help="engine mode: the head's training between steps (rollout.drafter.between_steps_s)")
    ap.add_argument("--min-draft-prob", dest="min_draft_prob", type=float, default=None,
                    help="engine mode and --choice: a fixed draft-budget threshold (default: priced from the "
                    "measured step cost)")
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args(argv)
    if args.ray:
        from benchmarks.bench_drafter_ray import main as ray_main

        return ray_main(rest + (["--reps", str(args.reps)] if args.reps else [])
                        + (["--out", args.out] if args.out else []))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.kinds = [k for k in args.kinds.split(",") if k]
    try:
        args.shapes = parse_shapes(args.shapes, args)
    except ValueError as e:
        ap.error(str(e))
    if args.choice:
        from benchmarks.bench_drafter_choice import choice_bench, choice_lines

        args.train_seconds, args.out = args.between, args.out or "bench_results/drafter_choice.json"
        result = choice_bench(args)
        for line in choice_lines(result):
            print(line, flush=True)
    elif args.offline:
        args.reps = args.reps or 30
        args.out = args.out or "bench_results/drafter_offline.json"
        result = offline(args)
    else:
        from benchmarks.bench_drafter_engine import engine_bench, ratios

        args.reps, args.reps_cost, args.train_seconds = args.reps or 2, 30, args.between
        args.out = args.out or "bench_results/drafter_engine.json"
        result = engine_bench(args)
        for line in ratios(result):
            print(line, flush=True)
    save_report({**result, "load_average_after": os.getloadavg()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
