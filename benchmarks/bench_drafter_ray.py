"""The drafter's spot trainer on Ray: the demo's rollout on 2 workers, idle-time training off / on.

    python -m benchmarks.bench_drafter --ray [--reps 3] [--out bench_results/drafter_ray.json]
    (the same as python -m benchmarks.bench_drafter_ray)

One backend (2 workers of 1 CPU: the demo policy, its cached warm-started head, the demo's
engine settings and proposers plus the drafter); each repetition rolls out the demo's step
(64 prompts x 8 samples, that repetition's seeds) twice, interleaved: with no training, then with
a training slice of --slice seconds given to an idle worker whenever one has no chunk (one
writer, versions published with the chunks; a chunk sent to a training worker stops its slice
at the next optimizer step). Reported per run: rollout seconds, tail seconds,
worker_busy_fraction, drafter_train_steps / slices / stopped / version, max_engine_wait_s (the
longest a chunk waited for a slice to give the engine back); tokens must be identical between
the two modes of a repetition.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from benchmarks.bench import save_report
from rollout import EngineConfig, SamplingParams, SpecConfig
from rollout.core.seeds import prompt_key, sample_seed
from scheduler.ray_backend import RayRolloutBackend

KEYS = ("rollout_seconds", "tail_seconds", "worker_busy_fraction", "drafter_train_steps", "drafter_slices",
        "drafter_stopped", "max_engine_wait_s", "drafter_version", "drafter_seconds", "engine_steps", "chunks")


def run(args) -> dict:
    from benchmarks.bench_drafter import demo_policy
    from rl_integration.config import RunConfig
    from rl_integration.demo.policy import load_or_warm_start_drafter

    load_start = os.getloadavg()
    _, tok, folder, make_problems, _ = demo_policy()
    run_cfg = RunConfig()
    d = run_cfg.rollout.drafter
    head = load_or_warm_start_drafter(folder, run_cfg.task.embedded, d.kind, d.warm_start_s, window=d.window,
                                      layer=d.layer())
    spec = run_cfg.rollout.engine.spec
    spec = SpecConfig(proposers=spec.proposers + ("drafter",), max_draft_tokens=spec.max_draft_tokens,
                      drafter=dataclasses.replace(d, path=head, idle_slice_s=args.slice))
    engine = EngineConfig(max_batch_size=64, max_model_len=1024, spec=spec)
    prompts = [tok(p.prompt)["input_ids"] for p in make_problems(run_cfg.task.embedded)]
    params = SamplingParams(temperature=1.0, max_tokens=512, stop_token_ids=[tok.eos_token_id])
    ids = [p for p in prompts for _ in range(8)]
    groups = [g for g in range(len(prompts)) for _ in range(8)]
    backend = RayRolloutBackend(folder, engine, num_workers=2, num_cpus_per_worker=1, start_timeout_s=300)
    runs = []
    try:
        for rep in range(args.reps):
            seeds = [sample_seed(0, prompt_key(p), i % 8, rep) for i, p in enumerate(ids)]
            outs = {}
            for mode, slice_s in (("off", None), ("on", args.slice)):
                backend.idle_training_s = slice_s
                start = time.perf_counter()
                outs[mode] = backend.generate(ids, params, seeds=seeds, groups=groups)
                m = backend.metrics()
                runs.append({"rep": rep, "mode": mode, "wall_seconds": time.perf_counter() - start,
                             **{k: m.get(k, 0) for k in KEYS}})
                print(json.dumps(runs[-1]), flush=True)
                if backend._drafter is not None:  # a slice still running must not spill into the next mode
                    backend._drafter.collect(timeout_s=60.0)
            assert [o.token_ids for o in outs["off"]] == [o.token_ids for o in outs["on"]], "tokens differ"
    finally:
        backend.shutdown()
    summary = {}
    for mode in ("off", "on"):
        rs = [r for r in runs if r["mode"] == mode]
        summary[mode] = {k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs)}
                         for k in ("rollout_seconds", "worker_busy_fraction", "tail_seconds")}
        summary[mode]["drafter_train_steps"] = [r["drafter_train_steps"] for r in rs]
        summary[mode]["max_engine_wait_s"] = max(r["max_engine_wait_s"] for r in rs)
    return {"runs": runs, "summary": summary, "slice_s": args.slice, "loadavg_start": load_start,
            "loadavg": os.getloadavg(),
            "note": "shared 2-core machine; 2 Ray workers of 1 CPU; off/on interleaved per repetition"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slice", type=float, default=1.0, help="rollout.drafter.idle_slice_s")
    ap.add_argument("--out", default="bench_results/drafter_ray.json")
    args = ap.parse_args(argv)
    result = run(args)
    s = result["summary"]
    print(f"rollout seconds off/on (median): {s['off']['rollout_seconds']['median']:.2f} / "
          f"{s['on']['rollout_seconds']['median']:.2f}; worker_busy_fraction off/on: "
          f"{s['off']['worker_busy_fraction']['median']:.3f} / {s['on']['worker_busy_fraction']['median']:.3f}; "
          f"drafter_train_steps per rollout with training: {s['on']['drafter_train_steps']}; the longest a chunk "
          f"waited for a slice: {s['on']['max_engine_wait_s'] * 1e3:.1f} ms")
    save_report({**result, "load_average_after": os.getloadavg()}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
