"""Whose turn it is on a Ray worker's engine: a chunk takes it from a training slice.

A drafter training slice runs in its own concurrency group, so the worker accepts a chunk while
it trains; but a chunk reads the head the slice trains, and the slice the policy the chunk runs,
so the engine goes to one call at a time, the chunk side first:
- `chunk_turn()` (run_chunk, update_weights) raises the stop flag and waits for the engine; the
  slice sees the flag between optimizer steps, so a chunk waits for one step at most;
- `slice_turn()` (train_drafter) waits for the engine and yields `should_stop`.
Both hold `_engine` (one lock) for as long as they touch anything; the flag is only a request,
lowered by the chunk side once it holds the engine (under `_chunk_side`, so two chunk-side calls
never interleave their raise and lower).

A slice takes only idle CPU: its thread runs at nice `slice_nice` (Linux, per thread), so where
workers share cores it does not slow the ones running the tail; a chunk raising the flag puts
it back to its old priority so the step it waits for is not starved (that needs root or
RLIMIT_NICE; without, the step ends at low priority).
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
