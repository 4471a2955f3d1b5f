"""Long-tail scheduling benchmark: static split vs divided rollout vs divided + context-aware order.

The workload is a GRPO rollout: P prompts x S samples, where a group's response length is a
property of its prompt (heavy-tailed, lognormal) and siblings differ by a little. The model is
a small random Llama, so lengths are set by max_tokens (no stop token) and the run time is
decoding. The scheduler never reads max_tokens: in the context-aware mode it learns a group's
length only from the group's probe, as it would in real RL.

All three modes run on the same Ray workers in one process, one after another, on the same
requests (same seeds), so their outputs must be token-identical -- the benchmark checks it.

    python -m scheduler.bench [--workers 2] [--prompts 16] [--samples 4] [--batch 4]
                              [--chunk 32] [--workloads 3] [--out bench_results/scheduler.json]

tail_seconds is the time from 90% of the samples finished to 100%. `steps` (target forwards, all
workers) and `fed tok` (tokens fed to them) measure the work each mode did, which a busy shared
machine does not blur: the divided modes do more of it, because each chunk re-prefills its
requests and a slot freed inside a chunk stays empty until the chunk ends (the engine keeps no
KV cache between runs). The machine's load is saved with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from rollout import EngineConfig, SamplingParams

from .ray_backend import RayRolloutBackend
from .rollout_scheduler import SchedulerConfig

MODES = ("static", "divided", "divided+context")


def bench_model(vocab: int = 1024, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def workload(prompts: int, samples: int, vocab: int, seed: int, median: int = 40, max_len: int = 448):
    """GRPO groups in random order: the group's length is lognormal(median, sigma 1) per prompt,
    clipped to [8, max_len]; each sample is within +-10% of it."""
    rng = np.random.default_rng(seed)
    group_len = np.clip(rng.lognormal(np.log(median), 1.0, size=prompts), 8, max_len).astype(int)
    ids, params, groups = [], [], []
    for g in range(prompts):
        p = rng.integers(3, vocab, size=int(rng.integers(16, 49))).tolist()
        for _ in range(samples):
            n = int(np.clip(round(group_len[g] * rng.uniform(0.9, 1.1)), 4, max_len))
            ids.append(p)
            params.append(SamplingParams(temperature=1.0, max_tokens=n))
            groups.append(g)
    seeds = rng.integers(0, 2**62, size=len(ids)).tolist()
    return ids, params, seeds, groups, group_len.tolist()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="max_batch_size of each worker's engine")
    ap.add_argument("--kept-slots", type=int, default=None,
                    help="KV slots each worker keeps for paused requests (default: --batch; 0: re-prefill every chunk)")
    ap.add_argument("--chunk", type=int, default=SchedulerConfig.chunk_tokens,
                    help="tokens per request per dispatch, at least")
    ap.add_argument("--growth", type=float, default=SchedulerConfig.chunk_growth,
                    help="chunk grows to this x the batch's longest context")
    ap.add_argument("--median", type=int, default=64, help="median group length (tokens)")
    ap.add_argument("--max-len", type=int, default=640, help="longest response (tokens)")
    ap.add_argument("--workloads", type=int, default=8, help="workload seeds (prompt orders)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mode per workload, in alternating order (the machine is shared)")
    ap.add_argument("--out", default="bench_results/scheduler.json")
    args = ap.parse_args(argv)

    vocab = 1024
    model = bench_model(vocab)
    kept = args.batch if args.kept_slots is None else args.kept_slots
    cfg = EngineConfig(max_batch_size=args.batch, max_model_len=args.max_len + 64, kept_slots=kept)
    t = time.perf_counter()
    backend = RayRolloutBackend(model, cfg, num_workers=args.workers, num_cpus_per_worker=1,
                                chunk_tokens=args.chunk)
    backend.scheduler_config.chunk_growth = args.growth
    print(f"{args.workers} workers up in {time.perf_counter() - t:.1f}s: "
          f"{[(i['host'], i['num_threads']) for i in backend.worker_info.values()]}")
    runs = []
    try:
        w_ids, w_params, w_seeds, w_groups, _ = workload(8, 2, vocab, seed=99, median=16, max_len=32)
        for mode in MODES:  # warm-up: first forwards of each worker, each path once
            backend.mode = mode
            backend.generate(w_ids, w_params, seeds=w_seeds, groups=w_groups)
        for k in range(args.workloads):
            ids, params, seeds, groups, group_len = workload(args.prompts, args.samples, vocab, seed=k,
                                                             median=args.median, max_len=args.max_len)
            reference = None  # the first run's tokens: every run of every mode must equal them
            print(f"\nworkload {k}: group lengths {group_len} "
                  f"({sum(p.max_tokens for p in params)} tokens)")
            for rep in range(args.repeats):
                for mode in (MODES if (rep + k) % 2 == 0 else MODES[::-1]):
                    backend.mode = mode
                    got = [o.token_ids for o in backend.generate(ids, params, seeds=seeds, groups=groups)]
                    reference = reference or got
                    if got != reference:
                        raise SystemExit(f"{mode}: tokens differ from the first run: the scheduler changed the output")
                    m = backend.metrics()
                    m.update(workload=k, repeat=rep)
                    runs.append(m)
                    print(f"  {mode:16s} rollout {m['rollout_seconds']:6.2f}s  tail {m['tail_seconds']:6.2f}s  "
                          f"busy {m['worker_busy_fraction']:.2f}  chunks {m['chunks']:3d}  "
                          f"steps {m['engine_steps']:5d} (most on a worker {m['max_worker_steps']:4d})  "
                          f"fed {m['fed_tokens']:6d}")
            print("  token-identical across modes and runs: True")
    finally:
        backend.shutdown()

    summary = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: statistics.mean(r[key] for r in rs)
                         for key in ("rollout_seconds", "tail_seconds", "worker_busy_fraction", "chunks",
                                     "engine_steps", "max_worker_steps", "fed_tokens")}
    base = summary["static"]
    per_workload = {}  # median over workloads of the per-workload cut (robust to one odd workload)
    for mode in MODES:
        cuts = []
        for k in range(args.workloads):
            t = statistics.mean(r["tail_seconds"] for r in runs if r["mode"] == mode and r["workload"] == k)
            t0 = statistics.mean(r["tail_seconds"] for r in runs if r["mode"] == "static" and r["workload"] == k)
            cuts.append(1 - t / t0 if t0 else 0.0)
        per_workload[mode] = cuts
    print(f"\nmean over {args.workloads} workloads x {args.repeats} runs ({args.prompts} prompts x {args.samples} "
          f"samples, {args.workers} workers, max_batch_size {args.batch}, chunk >= {args.chunk} tokens, "
          f"growth {args.growth})")
    print(f"{'mode':18s}{'rollout_s':>11s}{'tail_s':>9s}{'tail cut':>10s}{'median cut':>12s}"
          f"{'rollout cut':>13s}{'busy':>7s}{'steps':>8s}{'fed tok':>9s}")
    for mode in MODES:
        s = summary[mode]
        s["tail_cut_vs_static"] = 1 - s["tail_seconds"] / base["tail_seconds"] if base["tail_seconds"] else 0.0
        s["median_workload_tail_cut"] = statistics.median(per_workload[mode])
        s["workload_tail_cuts"] = per_workload[mode]
        s["rollout_cut_vs_static"] = 1 - s["rollout_seconds"] / base["rollout_seconds"]
        print(f"{mode:18s}{s['rollout_seconds']:11.2f}{s['tail_seconds']:9.2f}{s['tail_cut_vs_static']:10.0%}"
              f"{s['median_workload_tail_cut']:12.0%}{s['rollout_cut_vs_static']:13.0%}{s['worker_busy_fraction']:7.2f}"
              f"{s['engine_steps']:8.0f}{s['fed_tokens']:9.0f}")
    result = {"config": vars(args), "load_average_after": os.getloadavg(), "summary": summary, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
