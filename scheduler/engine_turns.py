"""Whose turn it is on a Ray worker's engine: a chunk takes it from a training slice.

A worker's drafter training slice (scheduler/drafter_slices.py) runs in its own Ray concurrency
group, so the worker accepts a chunk while a slice runs instead of queueing the chunk behind it.
The engine, its proposers and the draft head must still never be used by two calls at once: a
chunk reads the head the slice is training, and the slice reads the policy the chunk runs (and
that a weight update replaces). `EngineTurns` gives the engine to one call at a time, with
priority to the chunk side:

- `chunk_turn()` (run_chunk, update_weights: everything that uses the engine for outputs) raises
  the stop flag, then waits for the engine. The slice sees the flag between two optimizer
  steps and gives the engine back, so a chunk waits for at most one step, not a whole slice.
- `slice_turn()` (train_drafter) waits for the engine, then yields `should_stop`, a function the
  trainer calls before each optimizer step (drafter/trainer.py `train`).

The slice also takes only idle CPU: while it holds the engine its thread runs at nice
`slice_nice` (Linux: a thread's own nice value, set through its thread id). Where workers share
cores with each other -- more workers than cores, or a machine shared with other jobs -- a slice
at the default priority takes its share from the workers still running chunks, which are the
rollout's tail. When a chunk raises the stop flag it puts the slice's thread back to its old
priority, so the step it waits for is not starved in turn (that takes the right to raise a
priority: root or RLIMIT_NICE; without it the step finishes at low priority). Threads that the
trainer's own thread pool starts inherit the low priority and keep it.

Why the two calls can never hold the engine together: both take `_engine` (one lock) before they
touch anything, and release it only after their last use. The stop flag is only a request; it
is never what keeps them apart. The flag is lowered by the chunk side once it holds the engine
(under `_chunk_side`, so two chunk-side calls -- which Ray's default group runs one at a time
anyway -- never interleave their raise and lower): a slice that gets the engine after that
chunk trains until the next chunk-side call raises the flag again, and one that was waiting
behind a raised flag stops before its first step.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator, Optional


class EngineTurns:
    def __init__(self, wait_s: float = 300.0, slice_nice: int = 19):
        self.wait_s = wait_s  # how long a chunk waits for a slice to give the engine back
        self.slice_nice = slice_nice
        self._engine = threading.Lock()
        self._chunk_side = threading.Lock()
        self._stop = threading.Event()
        self._slice: Optional[tuple] = None  # (thread id, its nice before) of the slice holding the engine

    @contextlib.contextmanager
    def chunk_turn(self) -> Iterator[None]:
        """The engine for a call that must not wait for training: a running slice stops at its
        next optimizer step. TimeoutError if it does not within wait_s (a step that hangs)."""
        with self._chunk_side:
            self._stop.set()
            holder = self._slice
            if holder is not None:
                _set_nice(*holder)
            try:
                if not self._engine.acquire(timeout=self.wait_s):
                    raise TimeoutError(f"a drafter training slice did not give the engine back within "
                                       f"{self.wait_s}s (it stops between optimizer steps: one step hangs)")
            finally:
                self._stop.clear()
            try:
                yield
            finally:
                self._engine.release()

    @contextlib.contextmanager
    def slice_turn(self) -> Iterator[Callable[[], bool]]:
        """The engine for a training slice, once no chunk holds it; yields should_stop()."""
        with self._engine:
            tid = threading.get_native_id()
            before = _nice(tid)
            if before is not None:
                self._slice = (tid, before)
                _set_nice(tid, max(before, self.slice_nice))
            try:
                yield self._stop.is_set
            finally:
                self._slice = None
                if before is not None:
                    _set_nice(tid, before)


def _nice(tid: int) -> Optional[int]:
    """A thread's nice value; None where threads have none of their own (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None  # elsewhere PRIO_PROCESS names the whole process
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None


def _set_nice(tid: int, nice: int) -> None:
    # Only a thread of this process: the slice's thread may have ended and its id been reused.
    if not os.path.exists(f"/proc/self/task/{tid}"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # raising a priority takes root or RLIMIT_NICE: the step ends at low priority
        pass
