"""The drafter's spot trainer: training slices on workers the long tail leaves idle (TLT).

An idle worker is given `RolloutWorker.train_drafter(idle_slice_s)`: it trains its engine's draft
head on the responses it ran in this rollout (no features travel). One worker at a time is the
writer; when it runs a chunk, the next idle worker takes over from the last published version.
A slice runs in the worker's own concurrency group at low CPU priority, and a chunk sent meanwhile
takes the engine back at the next optimizer step (engine_turns.py), so slices use idle time only;
at the rollout's end the running slices are stopped the same way and counted in it.

Every slice that made progress is published: the driver puts the head's state in the object
store once (so the version outlives a dying writer) and sends (version, [ref]) with each chunk;
a worker loads a newer version before its chunk. Drafts never change tokens, so none of this
can change an output.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DrafterSlices:
    slice_s: Optional[float]  # None: publish only, never train
    published: Optional[tuple] = None  # (version, [ObjectRef of drafter.export.head_state])
    writer: Optional[int] = None
    inflight: dict = field(default_factory=dict)  # slice ObjectRef -> worker index
    counts: dict = field(default_factory=dict)  # this rollout's: steps, seconds, slices, stopped, published
    broken: bool = False  # a slice raised (not a lost worker): no more slices this rollout

    def new_rollout(self) -> None:
        self.counts = {"drafter_train_steps": 0, "drafter_train_seconds": 0.0, "drafter_slices": 0,
                       "drafter_stopped": 0, "drafter_published": 0}
        self.broken = False
        self.collect(timeout_s=0.0)  # a slice still running at the end of the last rollout

    def message(self) -> Optional[tuple]:
        """What travels with each chunk: the newest published version."""
        return self.published

    def give_slices(self, pool, busy: set) -> None:
        """The writer gets a slice whenever it has neither a chunk nor a slice in flight. With no
        writer, or one running a chunk (the long tail's request may keep it busy to the end), the
        first idle worker becomes it, starting from the last published version: one writer at a
        time, never two slices at once."""
        if self.broken or self.slice_s is None or self.inflight:
            return
        for w in pool.ready():
            if w in busy:
                continue
            if self.writer is None or self.writer not in pool.ready() or self.writer in busy:
                self.writer = w
            if w == self.writer:
                self.inflight[pool.train_drafter(w, self.slice_s, self.published)] = w

    def owns(self, ref) -> bool:
        return ref in self.inflight

    def receive(self, ref, timeout_s: float = 30.0) -> None:
        """A slice is back: count it and publish what it trained."""
        import ray

        w = self.inflight.pop(ref)
        try:
            res = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 -- training only ever costs speed: never fail the rollout
            from .rollout_scheduler import _is_worker_loss

            if not _is_worker_loss(e):
                warnings.warn(f"drafter training on worker {w} failed, no more slices this rollout: {e}",
                              stacklevel=2)
                self.broken = True
            if self.writer == w:
                self.writer = None
            return
        c = self.counts
        c["drafter_slices"] += 1
        c["drafter_train_steps"] += res.get("steps", 0)
        c["drafter_train_seconds"] += res.get("seconds", 0.0)
        c["drafter_stopped"] += int(bool(res.get("stopped")))
        if res.get("state") is not None and (self.published is None or res["version"] > self.published[0]):
            self.published = (res["version"], [ray.put(res["state"])])
            c["drafter_published"] += 1

    def end_rollout(self, pool, timeout_s: float = 30.0) -> None:
        """The rollout is over: stop the slices in flight at their next optimizer step and count
        and publish them in this rollout (training uses a rollout's idle time, not the trainer's)."""
        for w in set(self.inflight.values()):
            if w in pool.ready():
                pool.stop_drafter(w)  # its reply says nothing: the slice's own reply is the one awaited
        self.collect(timeout_s)

    def collect(self, timeout_s: float) -> None:
        """Publish the slices that are back within timeout_s (the others stay in flight)."""
        import ray

        if not self.inflight:
            return
        ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=timeout_s)
        for ref in ready:
            self.receive(ref)

    def latest(self, timeout_s: float) -> Optional[tuple]:
        """(version, drafter.export.head_state) of the newest published head, once the slices in
        flight are back (waiting up to timeout_s for them: a checkpoint saves what they trained);
        None when nothing was published."""
        import ray

        self.collect(timeout_s)
        if self.published is None:
            return None
        version, refs = self.published
        return version, ray.get(refs[0], timeout=60)

    def metrics(self) -> dict:
        return {**self.counts, "drafter_version": self.published[0] if self.published else 0}
