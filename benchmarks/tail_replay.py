"""Replay of the long-tail scheduler over a modelled engine, on a virtual clock (no model, no Ray).

A tool for tuning scheduler/rollout_scheduler.py without a busy machine's noise, not part of the
package: it replaces the `ray` module in this process with a stand-in whose wait() advances a
virtual clock to the next chunk's end. Each worker models spectail's engine as the benchmark runs
it (no stop tokens, no drafts): slots, Engine.run's max_steps and max_new_tokens, requests beyond
the slots admitted as slots free, kept KV with least-recently-kept eviction. A step costs
STEP_MS[0] + STEP_MS[1] x rows + STEP_MS[2] x fed tokens (ms, 1 thread, the bench's model on the
development CPU); the step counts, forwards on the busiest worker and fed tokens it reports equal
the real benchmark's (benchmarks/bench_scheduler.py) where timing does not change a decision.

    python benchmarks/tail_replay.py                     # the defaults, kept_slots 8
    python benchmarks/tail_replay.py 4:'{}' 8:'{"chunk_tokens": 80}'   # kept_slots:SchedulerConfig overrides
"""
import json
import math
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks  # noqa: E402,F401 -- first: it configures the process before torch loads
from rollout.core.request import Request, make_requests  # noqa: E402

STEP_MS = (3.4, 0.45, 0.068)
CHUNK_MS = 4.0  # a chunk's fixed cost on the worker (wire form, kept KV copies)
CLOCK = [0.0]


class Ref:
    def __init__(self, t, val):
        self.t, self.val = t, val


def fake_ray() -> types.ModuleType:
    ray = types.ModuleType("ray")

    def wait(refs, num_returns=1, timeout=None):
        t = min((r.t for r in refs if isinstance(r, Ref)), default=math.inf)
        CLOCK[0] = max(CLOCK[0], min(t, CLOCK[0] + timeout) if timeout is not None else t)
        ready = [r for r in refs if isinstance(r, Ref) and r.t <= CLOCK[0]][:num_returns]
        return ready, [r for r in refs if r not in ready]

    ray.wait, ray.get = wait, lambda ref, timeout=None: ref.val
    ray.exceptions = types.ModuleType("ray.exceptions")
    for name in ("RayActorError", "WorkerCrashedError", "ObjectLostError", "NodeDiedError", "GetTimeoutError"):
        setattr(ray.exceptions, name, type(name, (Exception,), {}))
    return ray


sys.modules["ray"] = fake_ray()
sys.modules["ray.exceptions"] = sys.modules["ray"].exceptions
import scheduler.rollout_scheduler as rs  # noqa: E402
from benchmarks.bench_scheduler import workload  # noqa: E402

rs.time = types.SimpleNamespace(perf_counter=lambda: CLOCK[0])


class Worker:
    def __init__(self, batch: int, kept_slots: int):
        self.batch, self.capacity, self.kept = batch, kept_slots, {}  # key -> True, least recent first

    def run(self, work: list[dict]) -> tuple[list[dict], float]:
        reqs = [Request.from_wire(w["request"], 1 << 20, 1 << 20, index=k) for k, w in enumerate(work)]
        starts = [len(r.output_ids) for r in reqs]
        budget, max_steps = work[0].get("max_new_tokens"), work[0].get("max_steps")
        keys = [(w["rollout"], w["id"]) for w in work]
        claimed = {k for k in keys if self.kept.pop(k, None)}
        for r in reqs:
            r.budget_end = len(r.output_ids) + budget if budget else None
        waiting, running, t, steps, fed, done_at = list(zip(reqs, keys)), [], CHUNK_MS, 0, 0, {}
        while waiting or running:
            while waiting and len(running) < self.batch:
                r, key = waiting.pop(0)
                r.num_cached = r.num_tokens - 1 if key in claimed else 0
                claimed.discard(key)
                running.append((r, key))
            n_fed = sum(r.num_tokens - r.num_cached for r, _ in running)
            t, steps, fed = t + STEP_MS[0] + STEP_MS[1] * len(running) + STEP_MS[2] * n_fed, steps + 1, fed + n_fed
            for r, _ in running:
                r.output_ids.append(0)
                r.logprobs.append(0.0)
                r.num_cached = r.num_tokens - 1
                r.finish_reason = "length" if len(r.output_ids) >= r.params.max_tokens else None
            if steps == max_steps:
                for r, _ in running:
                    r.budget_end = len(r.output_ids)
                waiting = []
            for r, key in [x for x in running if x[0].finish_reason or x[0].paused]:
                running.remove((r, key))
                if r.finish_reason:
                    done_at[id(r)] = t / 1000
                elif self.capacity:
                    if len(self.kept) >= self.capacity:
                        del self.kept[next(iter(self.kept))]
                    self.kept[key] = True
        self.kept.update(dict.fromkeys(claimed, True))  # claimed, never admitted: kept as they were
        kept = [k[1] for k in self.kept if k[0] == work[0]["rollout"]]
        return [{"id": w["id"], "token_ids": r.output_ids[n0:], "logprobs": r.logprobs[n0:],
                 "finish_reason": r.finish_reason, "stats": r.stats(),
                 "finished_at_s": done_at.get(id(r), 0.0) if r.finish_reason else None, "wall_s": t / 1000,
                 "engine_steps": steps, "fed_tokens": fed, "spec_off_steps": steps, "kept": kept}
                for r, w, n0 in zip(reqs, work, starts)], t / 1000


class Pool:
    def __init__(self, workers=2, batch=4, kept_slots=8):
        self.workers = {i: Worker(batch, kept_slots) for i in range(workers)}
        self.info = {i: {"kept_slots": kept_slots, "max_batch_size": batch} for i in range(workers)}
        self.num_slots, self.last_error = workers, None

    def ready(self):
        return sorted(self.workers)

    def max_batch(self, i):
        return self.info[i]["max_batch_size"]

    def submit(self, i, work, drafter=None):
        results, seconds = self.workers[i].run(work)
        return Ref(CLOCK[0] + seconds, results)

    def starting(self):
        return {}

    def started(self, ref):
        pass

    def fail(self, i, error):
        raise error


def rollout_of(mode: str, k: int, kept_slots: int, overrides: dict) -> dict:
    ids, params, seeds, groups, _ = workload(16, 4, 1024, seed=k, median=64, max_len=640)
    CLOCK[0] = 0.0
    config = rs.SchedulerConfig(mode=mode, **overrides)
    return rs.RolloutScheduler(Pool(kept_slots=kept_slots), config).run(
        make_requests(1024, 704, ids, params, seeds, None, groups), rollout_id=1)


def main(specs: list[str]) -> None:
    static = [rollout_of("static", k, 0, {}) for k in range(8)]
    base_s, base_tail = (sum(r[key] for r in static) for key in ("rollout_seconds", "tail_seconds"))
    for spec in specs or ["8:{}"]:
        kept, overrides = spec.split(":", 1)
        runs = [rollout_of("divided+context", k, int(kept), json.loads(overrides)) for k in range(8)]
        cuts = [1 - r["tail_seconds"] / s["tail_seconds"] for r, s in zip(runs, static)]
        print(f"kept_slots {kept} {overrides}: x static {sum(r['rollout_seconds'] for r in runs) / base_s:.3f}, "
              f"tail cut {1 - sum(r['tail_seconds'] for r in runs) / base_tail:.0%} "
              f"(per-workload median {statistics.median(cuts):.0%}), steps "
              f"{statistics.mean(r['engine_steps'] for r in runs):.0f}, most on a worker "
              f"{statistics.mean(r['max_worker_steps'] for r in runs):.0f}, fed "
              f"{statistics.mean(r['fed_tokens'] for r in runs):.0f}, "
              f"chunks {statistics.mean(r['chunks'] for r in runs):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
