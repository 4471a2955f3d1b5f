"""Long-tail scheduling benchmark: static split vs divided rollout vs divided + context-aware order.

The workload is a GRPO rollout: P prompts x S samples, where a group's response length is a
property of its prompt (heavy-tailed, lognormal) and siblings differ by a little. The model is
a small random Llama, so lengths are set by max_tokens (no stop token) and the run time is
decoding. The scheduler never reads max_tokens: in the context-aware mode it learns a group's
length only from the group's probe, as it would in real RL.

All three modes run on the same Ray workers in one process, one after another, on the same
requests (same seeds), so their outputs must be token-identical -- the benchmark checks it.

    python -m benchmarks.bench_scheduler [--workers 2] [--prompts 16] [--samples 4] [--batch 4] [--kept-slots N]
                              [--chunk 64] [--growth 1.0] [--extra 0.5] [--workloads 8] [--rounds 2]
                              [--out bench_results/scheduler.json]

Each round runs every workload in the three modes back to back, in alternating order; the table
gives per-rollout seconds (summed over the workloads of a round, min and median over rounds),
their ratio to static's (x static, from the medians) and the median over workloads and rounds of
each run's ratio to static's run of the same workload in the same round (paired).
tail_seconds is the time from 90% of the samples finished to 100%. `steps` (target forwards, all
workers), `most/w` (the most forwards one worker ran: the critical path) and `fed tok` (tokens
fed to them) measure the work each mode did, which a busy shared machine does not blur; `cpu/w`
is the critical path in CPU seconds (the most any worker's chunks took, mean per rollout), with
its ratio to static's: what the rollout would take with a core per worker and nothing else
running, blurred far less than the wall seconds by other jobs. With
`--kept-slots 0` the workers keep no KV, and every chunk re-prefills its requests (the divided
modes then feed far more tokens than static). The machine's load is printed and saved with the
results: on a 2-core machine shared with other jobs the seconds move from run to run, so only
the modes of one run are compared.
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
from scheduler.ray_backend import RayRolloutBackend
from scheduler.rollout_scheduler import SchedulerConfig

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


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="max_batch_size of each worker's engine")
    ap.add_argument("--kept-slots", type=int, default=None,
                    help="KV slots each worker keeps for paused requests (default: the Ray backend's, "
                         "2 x --batch on a CPU; 0: re-prefill every chunk)")
    ap.add_argument("--chunk", type=int, default=SchedulerConfig.chunk_tokens,
                    help="engine steps per chunk (new tokens per request where workers keep no KV), at least")
    ap.add_argument("--growth", type=float, default=SchedulerConfig.chunk_growth,
                    help="chunk grows to this x the longest context it prefills again")
    ap.add_argument("--extra", type=float, default=SchedulerConfig.extra_requests,
                    help="requests a chunk may carry beyond its slots, x max_batch_size")
    ap.add_argument("--median", type=int, default=64, help="median group length (tokens)")
    ap.add_argument("--max-len", type=int, default=640, help="longest response (tokens)")
    ap.add_argument("--workloads", type=int, default=8, help="workload seeds (prompt orders)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over all workloads; each workload runs the modes back to back, in alternating order")
    ap.add_argument("--out", default="bench_results/scheduler.json")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    vocab = 1024
    model = bench_model(vocab)
    cfg = EngineConfig(max_batch_size=args.batch, max_model_len=args.max_len + 64)
    t = time.perf_counter()
    load_before = os.getloadavg()
    backend = RayRolloutBackend(model, cfg, num_workers=args.workers, num_cpus_per_worker=1,
                                chunk_tokens=args.chunk, kept_slots=args.kept_slots)
    kept = next(iter(backend.worker_info.values()))["kept_slots"]
    backend.scheduler_config.chunk_growth = args.growth
    backend.scheduler_config.extra_requests = args.extra
    print(f"{args.workers} workers up in {time.perf_counter() - t:.1f}s: "
          f"{[(i['host'], i['num_threads']) for i in backend.worker_info.values()]}; kept_slots {kept}; "
          f"load average {load_before}")
    try:
        w_ids, w_params, w_seeds, w_groups, _ = workload(8, 2, vocab, seed=99, median=16, max_len=32)
        for mode in MODES:  # warm-up: first forwards of each worker, each path once
            backend.mode = mode
            backend.generate(w_ids, w_params, seeds=w_seeds, groups=w_groups)
        runs = run_rounds(backend, args, vocab)
    finally:
        backend.shutdown()
    summary = summarize(runs, args)
    result = {"config": {**vars(args), "kept_slots": kept}, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "summary": summary, "runs": runs}
    print(f"load average before {load_before}, after {result['load_average_after']} (a shared machine: "
          f"compare the modes within this run only)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def run_rounds(backend, args, vocab: int) -> list[dict]:
    """Every round runs every workload in every mode, the modes back to back in alternating order,
    and checks that every run's tokens equal the first run's."""
    runs, reference = [], {}
    for rnd in range(args.rounds):
        for k in range(args.workloads):
            ids, params, seeds, groups, group_len = workload(args.prompts, args.samples, vocab, seed=k,
                                                             median=args.median, max_len=args.max_len)
            if rnd == 0:
                print(f"\nworkload {k}: group lengths {group_len} ({sum(p.max_tokens for p in params)} tokens)")
            for mode in (MODES if (rnd + k) % 2 == 0 else MODES[::-1]):
                backend.mode = mode
                got = [o.token_ids for o in backend.generate(ids, params, seeds=seeds, groups=groups)]
                if reference.setdefault(k, got) != got:
                    raise SystemExit(f"{mode}: tokens differ from the first run: the scheduler changed the output")
                m = backend.metrics()
                m.update(workload=k, round=rnd, load_average=os.getloadavg()[0])
                runs.append(m)
                print(f"  round {rnd} {mode:16s} rollout {m['rollout_seconds']:6.2f}s  tail {m['tail_seconds']:5.2f}s  "
                      f"busy {m['worker_busy_fraction']:.2f}  chunks {m['chunks']:3d}  steps {m['engine_steps']:5d} "
                      f"(most on a worker {m['max_worker_steps']:4d})  fed {m['fed_tokens']:6d}")
        print(f"round {rnd}: token-identical across modes and runs: True")
    return runs


def summarize(runs: list[dict], args) -> dict:
    """Per mode: rollout and tail seconds summed over the workloads of a round, min and median over
    rounds; the rollout seconds over static's run of the same workload and round (median of these
    ratios: a load spike on the shared machine moves one pair, not the figure); the tail cut against
    static from the medians and per workload; the work (steps, the most steps one worker ran, fed
    tokens) per rollout."""
    def total(mode, rnd, key):
        return sum(r[key] for r in runs if r["mode"] == mode and r["round"] == rnd)

    def per_workload(mode, k, key):
        return statistics.median(r[key] for r in runs if r["mode"] == mode and r["workload"] == k)

    summary = {}
    for mode in MODES:
        rollout = [total(mode, rnd, "rollout_seconds") for rnd in range(args.rounds)]
        tail = [total(mode, rnd, "tail_seconds") for rnd in range(args.rounds)]
        n = args.workloads
        summary[mode] = {
            "rollout_seconds_min": min(rollout) / n, "rollout_seconds_median": statistics.median(rollout) / n,
            "tail_seconds_min": min(tail) / n, "tail_seconds_median": statistics.median(tail) / n,
            **{key: statistics.mean(r[key] for r in runs if r["mode"] == mode)
               for key in ("worker_busy_fraction", "chunks", "engine_steps", "max_worker_steps", "fed_tokens",
                           "reprefills", "max_worker_cpu_seconds")}}
    base = summary["static"]
    for mode in MODES:
        s = summary[mode]
        s["rollout_vs_static_median"] = s["rollout_seconds_median"] / base["rollout_seconds_median"]
        s["rollout_vs_static_min"] = s["rollout_seconds_min"] / base["rollout_seconds_min"]
        s["max_worker_cpu_vs_static"] = s["max_worker_cpu_seconds"] / base["max_worker_cpu_seconds"]
        s["paired_rollout_ratios"] = [r["rollout_seconds"] / b["rollout_seconds"] for r in runs if r["mode"] == mode
                                      for b in runs if b["mode"] == "static" and (b["workload"], b["round"]) ==
                                      (r["workload"], r["round"])]
        s["paired_rollout_ratio_median"] = statistics.median(s["paired_rollout_ratios"])
        s["tail_cut_vs_static"] = 1 - s["tail_seconds_median"] / base["tail_seconds_median"]
        s["workload_tail_cuts"] = [1 - per_workload(mode, k, "tail_seconds") / per_workload("static", k, "tail_seconds")
                                   for k in range(args.workloads)]
        s["median_workload_tail_cut"] = statistics.median(s["workload_tail_cuts"])
    print_table(summary, args)
    return summary


def print_table(summary: dict, args) -> None:
    print(f"\nper rollout, over {args.workloads} workloads x {args.rounds} rounds ({args.prompts} prompts x "
          f"{args.samples} samples, {args.workers} workers, max_batch_size {args.batch}, chunk >= {args.chunk}, "
          f"growth {args.growth}, extra {args.extra}); seconds: min / median over rounds")
    print(f"{'mode':17s}{'rollout_s':>13s}{'x static':>10s}{'paired':>8s}{'tail_s':>12s}{'tail cut':>10s}"
          f"{'median cut':>12s}{'busy':>6s}{'steps':>7s}{'most/w':>8s}{'cpu/w':>7s}{'x static':>9s}{'fed tok':>9s}")
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:17s}{s['rollout_seconds_min']:6.2f} /{s['rollout_seconds_median']:5.2f}"
              f"{s['rollout_vs_static_median']:10.2f}{s['paired_rollout_ratio_median']:8.2f}"
              f"{s['tail_seconds_min']:5.2f} /{s['tail_seconds_median']:5.2f}"
              f"{s['tail_cut_vs_static']:10.0%}{s['median_workload_tail_cut']:12.0%}{s['worker_busy_fraction']:6.2f}"
              f"{s['engine_steps']:7.0f}{s['max_worker_steps']:8.0f}{s['max_worker_cpu_seconds']:7.2f}"
              f"{s['max_worker_cpu_vs_static']:9.2f}{s['fed_tokens']:9.0f}")


if __name__ == "__main__":
    main()
