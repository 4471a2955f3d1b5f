"""Concurrent requests into one engine run.

verl sends one awaited request per sample; run one by one they would decode one sequence at a
time, and GRPO siblings would never draft for each other. The batcher starts a batch once no
request arrived for `window_s` (or `max_wait_s` after its first): verl's agent loops send a
batch at once, so a group meets in one run. The batch runs on a dedicated thread, so the actor
keeps taking requests and control calls (`call(fn)`, between batches); `abort()` answers the
queued requests at once and asks the running batch to stop with what it has.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Item:
    payload: Any
    future: asyncio.Future = field(repr=False)


class Batcher:
    def __init__(self, run_batch: Callable[[list, Callable[[], bool]], list], aborted: Callable[[Any], Any],
                 window_s: float = 0.05, max_wait_s: float = 2.0):
        self.run_batch, self.aborted = run_batch, aborted
        self.window_s, self.max_wait_s = window_s, max_wait_s
        self.queue: list[Item] = []
        self.arrived = asyncio.Event()
        self.engine_lock = asyncio.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectail-engine")
        self.stop_requested = False
        self.batches = 0  # batches started: a request's batch number says who it ran with
        self.running = 0  # requests in the batch on the engine now
        self.task = None

    async def submit(self, payload) -> Any:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._loop())
        item = Item(payload, asyncio.get_running_loop().create_future())
        self.queue.append(item)
        self.arrived.set()
        return await item.future

    async def _loop(self) -> None:
        while True:
            await self.arrived.wait()
            await self._settle()
            self.arrived.clear()
            batch, self.queue = self.queue, []
            if batch:
                await self._run(batch)

    async def _settle(self) -> None:
        """Wait until no request arrived for window_s, or max_wait_s since the first."""
        start, seen = time.monotonic(), -1
        while seen != len(self.queue) and time.monotonic() - start < self.max_wait_s:
            seen = len(self.queue)
            await asyncio.sleep(self.window_s)

    async def _run(self, batch: list[Item]) -> None:
        async with self.engine_lock:
            self.batches += 1
            self.stop_requested, self.running = False, len(batch)
            loop = asyncio.get_running_loop()
            try:
                results = await loop.run_in_executor(self.pool, self.run_batch, [i.payload for i in batch],
                                                     lambda: self.stop_requested)
            except Exception as e:  # the engine failed as a whole: every caller hears why
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                return
            finally:
                self.running = 0
        for item, result in zip(batch, results):
            if not item.future.done():
                item.future.set_result(result)

    def abort(self) -> int:
        """Answer the queued requests as aborted and stop the running batch; returns how many
        requests were waiting or running."""
        queued, self.queue = self.queue, []
        for item in queued:
            if not item.future.done():
                item.future.set_result(self.aborted(item.payload))
        self.stop_requested = self.running > 0
        return len(queued) + self.running

    async def call(self, fn: Callable, *args):
        """fn(*args) on the engine's thread, between batches."""
        async with self.engine_lock:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
