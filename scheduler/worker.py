"""The Ray worker: one engine per actor, running chunks of a divided rollout.

A worker keeps nothing between chunks that the output depends on: a work item carries its
request's whole state, so any worker with the same weights continues it with the same tokens.
What it keeps is speed only: a GRPO group's suffix index, and (with `kept_slots`) the KV of the
requests it paused, under (rollout id, scheduler id), so the same request sent back resumes
without prefill (weight updates and a chunk of another rollout drop them). `RolloutWorker` is a
plain class (the backend wraps it with `ray.remote`), so this module imports without Ray. Its
work items and results (the wire format): docs/architecture.md, "On Ray".

A chunk may carry the newest draft head. `train_drafter`, a training slice (drafter_slices.py),
runs in the concurrency group DRAFTER_GROUP: a chunk or weight update arriving meanwhile takes
the engine at the slice's next optimizer step (engine_turns.py). Other calls run in order.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Optional

from rollout import Engine, EngineConfig, cpu
from rollout.core.engine import RunStats
from rollout.core.request import Request

from .engine_turns import EngineTurns

# `train_drafter`'s Ray concurrency group (declared with ray.remote(concurrency_groups=...), chosen
# per call with .options(concurrency_group=...)); each group still runs its calls in order.
DRAFTER_GROUP = "drafter"


class RolloutWorker:
    """An engine behind a Ray actor. Created by the backend with
    `ray.remote(concurrency_groups=RolloutWorker.concurrency_groups)(RolloutWorker).options(num_cpus=...,
    num_gpus=...)`."""

    concurrency_groups = {DRAFTER_GROUP: 1}

    def __init__(self, source, engine_config: EngineConfig, index: int = 0):
        cpu.configure()  # an actor's process is spectail's (its environment has it already: ray_backend.py)
        self.index = index
        # a checkpoint folder, or the (Hugging Face config, state dict) pair in-memory weights travel as
        self.engine = Engine.from_pretrained(source, engine_config)
        self._rollout_groups: dict[Any, set] = {}  # rollout id -> group keys indexed here
        self.busy_s = 0.0
        self.chunks = 0
        self._drafter_online = None  # drafter.online.OnlineState when this worker trains the head
        self._drafter_refused: Optional[int] = None  # a published version that did not load here
        self._turns = EngineTurns()  # the engine to one call at a time, chunks before slices

    def ping(self) -> dict:
        # No engine turn: it must answer while a slice trains, and it only reads plain attributes.
        cfg = self.engine.config
        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname(),
                "vocab_size": self.engine.vocab_size, "max_batch_size": cfg.max_batch_size,
                "max_model_len": cfg.max_model_len, "device": cfg.device,
                "num_threads": self.engine.num_threads, "busy_s": self.busy_s, "chunks": self.chunks,
                "kept_slots": self.engine.kept.capacity, **self._drafter_info()}

    def _drafter_info(self) -> dict:
        dp = self._drafter()
        if dp is None:
            return {}
        return {"drafter_version": dp.head_version, "drafter_off": dp.head is None,
                "drafter_refused": self._drafter_refused,
                "drafter_buffer_tokens": dp.buffer.total_tokens if dp.buffer is not None else 0}

    def update_weights(self, weights) -> int:
        """weights: a state dict (Ray resolves the ObjectRef the backend passes). All or nothing."""
        with self._turns.chunk_turn():  # a slice must not train against weights being replaced
            return self.engine.update_weights(weights)

    def run_chunk(self, work: list[dict], drafter: Optional[tuple] = None) -> list[dict]:
        asked = time.perf_counter()
        with self._turns.chunk_turn():
            waited = time.perf_counter() - asked
            results = self._run_chunk(work, drafter)
        for r in results:
            r["engine_wait_s"] = waited
        return results

    def train_drafter(self, seconds: float, drafter: Optional[tuple] = None) -> dict:
        """A training slice of about `seconds` on the responses of the current rollout this worker
        ran; a chunk arriving meanwhile ends it at the next optimizer step. Returns steps, seconds,
        stopped (a chunk ended it), the head's version and, if it trained, its state to publish
        (what a stopped slice trained is published like any other)."""
        with self._turns.slice_turn() as should_stop:
            return self._train_drafter(seconds, drafter, should_stop)

    def stop_drafter_slice(self) -> None:
        """Returns once no training slice holds the engine: one running stops at its next
        optimizer step (the driver's way to end training when a rollout is over)."""
        with self._turns.chunk_turn():
            return None

    # ---- internals ---------------------------------------------------------------------------

    def _run_chunk(self, work: list[dict], drafter: Optional[tuple]) -> list[dict]:
        t0, cpu0 = time.perf_counter(), time.process_time()
        self._load_drafter(drafter)
        dp = self._drafter()
        head_s = dp.stats["seconds"] if dp is not None else 0.0
        self._forget_other_rollouts({w.get("rollout") for w in work})
        results, done = [], RunStats()
        for budget, items in by_budget(work).items():
            part, run = self._run(items, budget, t0)
            results += part
            done = RunStats(done.steps + run.steps, done.spec_off_steps + run.spec_off_steps,
                            done.fed_tokens + run.fed_tokens)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        drafter_s = dp.stats["seconds"] - head_s if dp is not None else 0.0
        kept = [key[1] for key in self.engine.kept.keys() if key[0] == work[0].get("rollout")] if work else []
        for r in results:
            r.update(wall_s=wall, cpu_s=cpu, engine_steps=done.steps, fed_tokens=done.fed_tokens,
                     spec_off_steps=done.spec_off_steps, drafter_seconds=drafter_s, kept=kept)
        self.busy_s += wall
        self.chunks += 1
        return results

    def _train_drafter(self, seconds: float, drafter: Optional[tuple], should_stop) -> dict:
        from drafter.export import head_state
        from drafter.online import OnlineState, train_on_buffer

        self._load_drafter(drafter)
        dp = self._drafter()
        if dp is None or dp.buffer is None:
            return {"steps": 0, "seconds": 0.0, "stopped": False, "version": 0, "state": None}
        cfg = self._online_config(dp)
        self._drafter_online = self._drafter_online or OnlineState()
        if self._drafter_refused is not None:  # versions go on after the one refused here
            dp.head_version = max(dp.head_version, self._drafter_refused)
        report = train_on_buffer(dp, self._drafter_online, cfg, seconds, current_only=True, should_stop=should_stop)
        trained = report.get("drafter_train_steps", 0) > 0 and dp.head is not None
        return {"steps": report.get("drafter_train_steps", 0), "seconds": report.get("drafter_train_seconds", 0.0),
                "stopped": report.get("drafter_train_stopped", False),
                "version": dp.head_version, "state": head_state(dp.head) if trained else None}

    def _online_config(self, dp):
        from drafter.online import OnlineConfig

        # The engine's thread count: the slice runs in another thread of this process (its
        # concurrency group's), and torch's count is per thread, so the trainer sets it for the
        # slice (drafter/trainer.py, threads.using) as the engine sets its own for a chunk.
        return OnlineConfig(dp.spec, num_threads=self.engine.num_threads)

    def _drafter(self):
        from drafter.proposer import DrafterProposer

        return DrafterProposer.of(self.engine)

    def _load_drafter(self, drafter: Optional[tuple]) -> None:
        """Load a newer published head version (one that fails is not tried again)."""
        if drafter is None:
            return
        version, refs = drafter
        dp = self._drafter()
        if dp is None or version == self._drafter_refused or (dp.head is not None and version <= dp.head_version):
            return
        import ray

        if not dp.load(ray.get(refs[0], timeout=60), version):
            self._drafter_refused = version

    def _run(self, items: list[dict], budget: Optional[int], t0: float) -> tuple[list[dict], RunStats]:
        eng = self.engine
        reqs = [Request.from_wire(w["request"], eng.vocab_size, eng.config.max_model_len, index=i)
                for i, w in enumerate(items)]
        for r, w in zip(reqs, items):
            r.group = self._group_key(r.group, w.get("rollout"))
        starts = [len(r.output_ids) for r in reqs]
        finished_at: dict[int, float] = {}
        keep = [(w.get("rollout"), w["id"]) if w.get("rollout") is not None else None for w in items]
        run = eng.run(reqs, max_new_tokens=budget,
                      on_finish=lambda r: finished_at.__setitem__(r.index, time.perf_counter() - t0),
                      keep=keep if eng.kept.capacity else None, max_steps=items[0].get("max_steps"))
        return chunk_results(reqs, items, starts, lambda i: finished_at.get(i, 0.0)), run

    def _group_key(self, group, rollout):
        if group is None or rollout is None:
            return group
        self._rollout_groups.setdefault(rollout, set()).add((rollout, group))
        return (rollout, group)  # group ids are only unique within one rollout

    def _forget_other_rollouts(self, current: set) -> None:
        """Drop the suffix indexes of groups, and the kept KV, of earlier rollouts (they are done)."""
        self.engine.kept.drop(lambda key: key[0] not in current)
        for rollout in [r for r in self._rollout_groups if r not in current]:
            self.engine.release_groups(self._rollout_groups.pop(rollout))


def by_budget(work: list[dict]) -> dict[Optional[int], list[dict]]:
    """A chunk's work items by max_new_tokens (the scheduler sends one budget per batch)."""
    out: dict[Optional[int], list[dict]] = {}
    for w in work:
        out.setdefault(w.get("max_new_tokens"), []).append(w)
    return out


def chunk_results(reqs: list[Request], items: list[dict], starts: list[int], finished_at) -> list[dict]:
    """One result per request run (module docstring); finished_at(i): seconds to request i's end."""
    return [{"id": w["id"], "token_ids": r.output_ids[n0:], "logprobs": r.logprobs[n0:],
             "finish_reason": r.finish_reason, "stats": r.stats(),
             "finished_at_s": finished_at(i) if r.finish_reason else None}
            for i, (r, w, n0) in enumerate(zip(reqs, items, starts))]
