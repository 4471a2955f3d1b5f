"""The long-tail scheduler: divided rollout, context-aware order, balancing, recovery.

Requests run in chunks and return paused to one global queue, so any worker can continue them
(a token is a pure function of weights, prompt, seed and position). The scheduler holds the only
copy of each request's state and applies a chunk only when it is whole, so a dead worker costs
time only. Each worker has at most one batch in flight; the loop waits on all of them at once.

Which requests go where (affinity to kept KV, balance, GRPO groups, the context-aware order
after Seer), the modes and `run`'s figures: docs/architecture.md, "On Ray". max_tokens is never read.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from rollout.backend import tail_seconds
from rollout.core.request import Request

MODES = ("static", "divided", "divided+context")


@dataclass
class SchedulerConfig:
    mode: str = "divided+context"
    chunk_tokens: int = 64  # engine steps per chunk where KV is kept, else new tokens per request, at least
    chunk_growth: float = 1.0  # where KV is not kept: at least this times the batch's longest context
    extra_requests: float = 0.5  # a batch may carry this x max_batch_size requests beyond its slots
    probe_factor: float = 2.0  # a group whose leader has run P tokens is estimated at this x P
    aging: float = 0.02  # priority gained per pass-over, in units of chunk_tokens
    preempt_margin: float = 2.0  # a kept request ranks this many chunk_tokens higher where it is kept
    poll_s: float = 0.5  # ray.wait timeout: how often the loop checks deadlines and restarts
    chunk_timeout_s: float = 3600.0  # a batch not back by then counts as a dead worker

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if int(self.chunk_tokens) != self.chunk_tokens or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an integer >= 1, got {self.chunk_tokens}")
        for name in ("aging", "preempt_margin", "chunk_growth", "extra_requests"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.probe_factor >= 1:
            raise ValueError(f"probe_factor must be >= 1, got {self.probe_factor}")
        if not (self.poll_s > 0 and self.chunk_timeout_s > 0):
            raise ValueError("poll_s and chunk_timeout_s must be > 0")


class RolloutScheduler:
    """Runs a list of engine Requests (the backend validates and builds them) on a worker pool.

    The pool (see ray_backend.WorkerPool) provides: ready() -> live worker indices;
    max_batch(i); submit(i, work) -> ObjectRef; fail(i, error) (marks it dead, maybe starts a
    replacement); starting() -> {ping ObjectRef: index}; started(ref) (a replacement is up or
    failed); num_slots; last_error.
    """

    def __init__(self, pool, config: SchedulerConfig, on_idle: Optional[Callable[[int], None]] = None,
                 on_chunk: Optional[Callable[[int, list], None]] = None, drafter=None):
        config.validate()
        self.pool, self.config = pool, config
        self.on_idle, self.on_chunk = on_idle, on_chunk
        self.drafter = drafter  # scheduler.drafter_slices.DrafterSlices: training on idle workers

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, requests: list[Request], rollout_id=None) -> dict:
        """Run the requests to the end (they are updated in place); returns the rollout's metrics."""
        self.start(requests, rollout_id)
        if self.drafter is not None:
            self.drafter.new_rollout()
        unfinished = len(self.pending)
        t0 = time.perf_counter()
        while unfinished:
            self._dispatch(self.idle_told)
            self._use_idle_workers()
            ready = self._wait(unfinished)
            now = time.perf_counter()
            unfinished -= self._collect(ready, now - t0)
            self._expire(now)
        elapsed = time.perf_counter() - t0
        if self.drafter is not None:
            self.drafter.end_rollout(self.pool)
        if self.on_idle is not None:
            for w in self.pool.ready():
                if w not in self.idle_told:
                    self.on_idle(w)
        return self._metrics(elapsed, list(self.finish_times.values()))

    def _use_idle_workers(self) -> None:
        """Drafter training slices, and on_idle once per worker that has nothing in flight."""
        if self.drafter is not None:
            self.drafter.give_slices(self.pool, self._busy_workers())
        if self.on_idle is not None:
            for w in self.pool.ready():
                if w not in self._busy_workers() and w not in self.idle_told:
                    self.idle_told.add(w)
                    self.on_idle(w)

    def _wait(self, unfinished: int) -> list:
        """What came back (chunks, replacements starting, slices) within poll_s."""
        import ray

        waits = list(self.inflight) + list(self.pool.starting())
        if not waits:
            raise RuntimeError(f"no rollout worker left to run {unfinished} unfinished requests; "
                               f"last worker error: {self.pool.last_error}")
        slices = list(self.drafter.inflight) if self.drafter is not None else []
        return ray.wait(waits + slices, num_returns=1, timeout=self.config.poll_s)[0]

    def _collect(self, ready: list, now: float) -> int:
        """Fold in what came back; returns how many requests finished. `now`: seconds since the start."""
        import ray
        from ray.exceptions import GetTimeoutError

        done = 0
        for ref in ready:
            if self.drafter is not None and self.drafter.owns(ref):
                self.drafter.receive(ref)
                continue
            if ref not in self.inflight:
                self.pool.started(ref)  # a replacement is up (or failed to start)
                continue
            w, ids, _ = self.inflight.pop(ref)
            try:
                results = ray.get(ref, timeout=max(self.config.poll_s, 10.0))
            except Exception as e:  # noqa: BLE001 -- sorted below
                if not _is_worker_loss(e) and not isinstance(e, GetTimeoutError):
                    raise  # the worker ran and raised: a bug or bad input, not a lost worker
                self._lose(w, ids, e)
                continue
            done += self._receive(w, ids, results, now)
        return done

    def _expire(self, now: float) -> None:
        """A batch out longer than chunk_timeout_s counts as a lost worker."""
        limit = self.config.chunk_timeout_s
        for ref, (w, ids, since) in list(self.inflight.items()):
            if now - since > limit:
                del self.inflight[ref]
                self._lose(w, ids, TimeoutError(f"worker {w} did not return a chunk within chunk_timeout_s={limit}"))

    def start(self, requests: list[Request], rollout_id=None) -> None:
        """A new rollout's state: nothing kept, nothing in flight, every unfinished request queued."""
        self.reqs = {i: r for i, r in enumerate(requests)}
        self.rollout_id = rollout_id
        self.idle_told: set = set()  # workers told on_idle since their last batch
        self.gkey = {i: (("g", r.group) if r.group is not None else ("solo", i)) for i, r in self.reqs.items()}
        self.probe = {}  # group -> request id of its probe
        for i in self.reqs:
            self.probe.setdefault(self.gkey[i], i)
        self.home: dict = {}  # group -> worker index
        self.holder: dict = {}  # request id -> the worker keeping its KV (it resumes there without prefill)
        self.kept_on: dict = {}  # worker -> the request ids it reported keeping
        self.group_len: dict = {}  # group -> longest finished member
        self.lead: dict = {}  # group -> most tokens any member has produced
        for i, r in self.reqs.items():
            self.lead[self.gkey[i]] = max(self.lead.get(self.gkey[i], 0), len(r.output_ids))
        self.skipped = {i: 0 for i in self.reqs}
        self.pending = [i for i, r in self.reqs.items() if r.finish_reason is None]
        self.inflight: dict = {}  # ObjectRef -> (worker, ids, dispatch time)
        self.busy_s: dict = {}  # worker -> seconds inside chunks
        self.cpu_s: dict = {}  # worker -> CPU seconds of its chunks (where the worker reports them)
        self.worker_steps: dict = {}  # worker -> engine steps it ran
        self.finish_times: dict = {}  # request id -> seconds from the start of the rollout
        self.counts = {"chunks": 0, "group_moves": 0, "worker_failures": 0, "requeued_requests": 0,
                       "engine_steps": 0, "fed_tokens": 0, "spec_off_steps": 0, "drafter_seconds": 0.0,
                       "reprefills": 0, "reprefill_tokens": 0, "max_engine_wait_s": 0.0}

    def _receive(self, w: int, ids: list[int], results: list[dict], now: float) -> int:
        """Fold a returned chunk into the requests; paused ones go back to the queue. Returns
        how many finished. `now`: seconds since the rollout started."""
        self.counts["chunks"] += 1
        if results:
            first = results[0]  # per-call figures are repeated in every result
            self.busy_s[w] = self.busy_s.get(w, 0.0) + first["wall_s"]
            self.cpu_s[w] = self.cpu_s.get(w, 0.0) + first.get("cpu_s", 0.0)
            self.worker_steps[w] = self.worker_steps.get(w, 0) + first.get("engine_steps", 0)
            for key in ("engine_steps", "fed_tokens", "spec_off_steps", "drafter_seconds"):
                self.counts[key] += first.get(key, 0)
            self.counts["max_engine_wait_s"] = max(self.counts["max_engine_wait_s"], first.get("engine_wait_s", 0.0))
            self._note_kept(w, ids, first.get("kept", ()))
        back, done = set(ids), 0
        for res in results:
            i = res["id"]
            if i not in back:
                continue
            back.discard(i)
            r = self.reqs[i]
            _apply(r, res)
            self.lead[self.gkey[i]] = max(self.lead.get(self.gkey[i], 0), len(r.output_ids))
            if r.finish_reason is None:
                self.pending.append(i)
                continue
            done += 1
            # the worker's clock only gives durations: its last token came this long before the end
            self.finish_times[i] = now - (res["wall_s"] - res["finished_at_s"])
            g = self.gkey[i]
            self.group_len[g] = max(self.group_len.get(g, 0), len(r.output_ids))
        self.pending.extend(sorted(back))  # (a worker that dropped some: run them again)
        if self.on_chunk is not None:
            self.on_chunk(w, results)
        return done

    def _note_kept(self, w: int, ids: list[int], kept) -> None:
        """Worker w keeps the KV of `kept` (its report after a chunk of `ids`): what it paused now is
        held there; what it no longer keeps (evicted, finished) is held nowhere."""
        kept = set(kept)
        for i in self.kept_on.get(w, set()) - kept:
            if self.holder.get(i) == w:
                del self.holder[i]
        for i in ids:
            if i in kept:
                self.holder[i] = w
        self.kept_on[w] = kept

    def _forget_kept(self, w: int) -> None:
        for i in self.kept_on.pop(w, set()):
            if self.holder.get(i) == w:
                del self.holder[i]

    # ---- choosing work -----------------------------------------------------------------------

    def _busy_workers(self) -> set:
        return {w for w, _, _ in self.inflight.values()}

    def _dispatch(self, idle_told: set) -> None:
        ready = self.pool.ready()
        for w in ready:
            if not self.pending:
                return
            if w in self._busy_workers():
                continue
            idle = [v for v in ready if v not in self._busy_workers()]
            ids = self._pick(w, len(ready), len(idle))
            if not ids:
                continue
            budget = self._budget(w, ids)
            work = [self._item(i, budget, self._keeps(w)) for i in ids]
            try:
                ref = self.pool.submit(w, work, self.drafter.message() if self.drafter is not None else None)
            except Exception as e:  # noqa: BLE001 -- a dead handle fails at submit on some versions
                if not _is_worker_loss(e):
                    raise
                self._lose(w, ids, e, requeue_front=True)
                continue
            self.inflight[ref] = (w, ids, time.perf_counter())
            idle_told.discard(w)

    def _pick(self, w: int, n_ready: int, n_idle: int) -> list[int]:
        """Take this worker's share of the queue (and remove it from the queue)."""
        cfg = self.config
        if cfg.mode == "static":
            # An even split over the idle workers, in order, each run to the end.
            share = math.ceil(len(self.pending) / max(1, n_idle))
            ids, self.pending = self.pending[:share], self.pending[share:]
            return ids
        live = set(self.pool.ready())
        ids = self._choose(w, n_ready, live)
        chosen = set(ids)
        self.pending = [i for i in self.pending if i not in chosen]
        for i in self.pending:
            self.skipped[i] += 1
        for i in ids:
            r = self.reqs[i]
            if r.output_ids and (self.holder.get(i) != w or not self._keeps(w)):  # prefilled again there
                self.counts["reprefills"] += 1
                self.counts["reprefill_tokens"] += len(r.prompt_ids) + len(r.output_ids) - 1
            g = self.gkey[i]
            home = self.home.get(g)
            if home is None or home not in live:
                self.home[g] = w
            elif home != w:
                self.counts["group_moves"] += 1
        return ids

    def _choose(self, w: int, n_ready: int, live: set) -> list[int]:
        """The requests of w's next batch: at most its slots, its fair share of the unfinished ones
        (but never fewer than the requests it keeps that rank among its slots), and where it keeps KV
        a share of the surplus beyond its slots, which the engine admits as slots free in the chunk."""
        cfg = self.config
        in_flight = sum(len(ids) for _, ids, _ in self.inflight.values())
        slots = self.pool.max_batch(w)
        share = math.ceil((len(self.pending) + in_flight) / max(1, n_ready))
        cands = self._ranked(w, live) if cfg.mode == "divided+context" else self._fifo(w, live)
        n = min(slots, max(share, sum(self.holder.get(i) == w for i in cands[:slots])))
        if not self._keeps(w):
            return cands[:n]
        # Beyond its slots, a share of the surplus: it refills the slots freed inside the chunk (only
        # where paused requests keep their KV: elsewhere one admitted late would re-prefill for little).
        # Not its own displaced requests: carried here they would wait for a slot to free while another
        # worker could run them.
        rest = cands[n:] if cfg.mode != "divided+context" else [i for i in cands[n:] if self.holder.get(i) != w]
        extra = min(int(cfg.extra_requests * slots), len(rest) // max(1, n_ready))
        return cands[:n] + rest[:extra]

    def _fifo(self, w: int, live: set) -> list[int]:
        """Divided mode: w's own (whose KV it keeps; left waiting, another worker would take and
        re-prefill them) first, then its groups', then others', each in the queue's order."""
        own, free = self._affinity(w, list(self.pending), live)
        local = [i for i in free if self.home.get(self.gkey[i], w) == w or self.home[self.gkey[i]] not in live]
        mine = set(local)
        return own + local + [i for i in free if i not in mine]

    def _ranked(self, w: int, live: set) -> list[int]:
        """Context-aware mode: w's candidates by priority, a request kept here `preempt_margin`
        chunks higher and one kept elsewhere as much lower (so requests do not swap at every chunk),
        those kept on an idle worker within its next batch left to it; on equal estimates, members
        of the groups w runs first."""
        margin = self.config.preempt_margin * self.config.chunk_tokens
        busy, theirs = self._busy_workers(), {}
        for i in self.pending:
            h = self.holder.get(i)
            if h is not None and h != w and h in live and h not in busy:
                theirs.setdefault(h, []).append(i)
        left = {i for h, ids in theirs.items() for i in self._ordered(ids)[:self.pool.max_batch(h)]}

        def key(i):
            h, home = self.holder.get(i), self.home.get(self.gkey[i], w)
            bonus = margin if h == w else -margin if h is not None and h in live else 0.0
            cls, est, tie = self._priority(i)
            return cls, est + bonus, home == w or home not in live, tie

        return sorted((i for i in self.pending if i not in left), key=key, reverse=True)

    def _affinity(self, w: int, order: list[int], live: set) -> tuple[list[int], list[int]]:
        """(own, free): the queue's requests whose KV w keeps (a batch at most), and those it may
        take besides. A request kept on an idle live worker within that worker's next batch stays
        for it (moving costs a re-prefill); one beyond it, or held by a busy worker, is free."""
        own, free, theirs = [], [], {}
        for i in order:
            h = self.holder.get(i)
            if h == w:
                own.append(i)
            elif h is None or h not in live:
                free.append(i)
            else:
                theirs.setdefault(h, []).append(i)
        slots, busy = self.pool.max_batch(w), self._busy_workers()
        for h, ids in theirs.items():
            free += ids[0 if h in busy else self.pool.max_batch(h):]
        rank = {i: n for n, i in enumerate(order)}
        return own[:slots], sorted(free + own[slots:], key=rank.__getitem__)

    def _ordered(self, ids: Optional[list[int]] = None) -> list[int]:
        """Probes first, then longest estimated remaining first, aged (the queue, or `ids`)."""
        return sorted(self.pending if ids is None else ids, key=self._priority, reverse=True)

    def _priority(self, i: int) -> tuple:
        """(class, estimated remaining tokens + aging, tie-break): larger runs first. Probes (class
        1, by tokens produced): unstarted ones first (find every group's length early), then the
        furthest along."""
        cfg = self.config
        g, out = self.gkey[i], len(self.reqs[i].output_ids)
        if g in self.group_len:
            est_total = self.group_len[g]
        elif self.probe[g] == i:
            return (1, math.inf if out == 0 else out, -i)
        else:  # unfinished group: heavy-tailed lengths, so one that ran P tokens runs ~2P
            lead = self.lead.get(g, 0)
            est_total = max(cfg.probe_factor * lead, lead + cfg.chunk_tokens)
        remaining = max(est_total - out, 1)
        return (0, remaining + cfg.aging * cfg.chunk_tokens * self.skipped[i], -i)

    def _keeps(self, w: int) -> bool:
        """Whether worker w's engine keeps paused requests' KV (EngineConfig.kept_slots)."""
        return getattr(self.pool, "info", {}).get(w, {}).get("kept_slots", 0) > 0

    def _budget(self, w: int, ids: list[int]) -> Optional[int]:
        """The chunk: chunk_tokens engine steps on a worker that keeps KV (only a moved request
        prefills again, once); elsewhere every chunk re-prefills, so new tokens per request, at
        least chunk_growth x the longest context."""
        cfg = self.config
        if cfg.mode == "static":
            return None
        if self._keeps(w):
            return cfg.chunk_tokens
        again = [len(self.reqs[i].prompt_ids) + len(self.reqs[i].output_ids) for i in ids]
        return max(cfg.chunk_tokens, math.ceil(cfg.chunk_growth * max(again, default=0)))

    def _item(self, i: int, budget: Optional[int], keeps: bool) -> dict:
        return {"id": i, "rollout": self.rollout_id, "max_new_tokens": None if keeps else budget,
                "max_steps": budget if keeps else None, "request": self.reqs[i].to_wire()}

    # ---- failures and metrics ------------------------------------------------------------------

    def _lose(self, w: int, ids: list[int], error: Exception, requeue_front: bool = False) -> None:
        """Worker w is gone: its requests go back to the queue as they were before the chunk."""
        self.counts["worker_failures"] += 1
        self.counts["requeued_requests"] += len(ids)
        for ref, (v, more, _) in list(self.inflight.items()):
            if v == w:  # (never more than one batch per worker, but be safe)
                del self.inflight[ref]
                ids = ids + more
        self.pending = ids + self.pending if requeue_front else self.pending + ids
        for g in [g for g, h in self.home.items() if h == w]:
            del self.home[g]
        self._forget_kept(w)
        self.pool.fail(w, error)

    def _metrics(self, elapsed: float, finish_times: list[float]) -> dict:
        reqs = list(self.reqs.values())
        generated = sum(len(r.output_ids) for r in reqs)
        slots = max(1, self.pool.num_slots)
        return {
            "mode": self.config.mode,
            "chunk_tokens": None if self.config.mode == "static" else self.config.chunk_tokens,
            "chunk_growth": None if self.config.mode == "static" else self.config.chunk_growth,
            "num_workers": slots,
            "num_samples": len(reqs),
            "rollout_seconds": elapsed,
            "tail_seconds": tail_seconds(finish_times),
            "worker_busy_fraction": sum(self.busy_s.values()) / (elapsed * slots) if elapsed > 0 else 0.0,
            "worker_busy_seconds": {w: round(s, 4) for w, s in sorted(self.busy_s.items())},
            "worker_cpu_seconds": {w: round(s, 4) for w, s in sorted(self.cpu_s.items())},
            "max_worker_cpu_seconds": max(self.cpu_s.values(), default=0.0),
            "max_worker_steps": max(self.worker_steps.values(), default=0),
            "generated_tokens": generated,
            "tokens_per_second": generated / elapsed if elapsed > 0 else 0.0,
            "forward_passes": sum(r.forward_passes for r in reqs),
            **self.counts,
            **(self.drafter.metrics() if self.drafter is not None else {}),
        }


def _apply(r: Request, res: dict) -> None:
    """Fold one chunk's result into the scheduler's copy of the request."""
    r.output_ids.extend(res["token_ids"])
    r.logprobs.extend(res["logprobs"])
    r.set_stats(res["stats"])  # cumulative: the worker started from ours
    r.finish_reason = res["finish_reason"]


class WorkerLost(RuntimeError):
    """A worker raises this when it can run nothing more (its engine is gone) while its process
    lives on: the scheduler treats it as a lost worker (requeues its requests, replaces it) and the
    message, unlike Ray's for a dead actor, says why. Ray re-raises it in the driver as a
    RayTaskError that is also an instance of this class."""


def _is_worker_loss(e: BaseException) -> bool:
    from ray import exceptions as rx

    return isinstance(e, (rx.RayActorError, rx.WorkerCrashedError, rx.ObjectLostError, rx.NodeDiedError, WorkerLost))
