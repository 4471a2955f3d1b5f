"""How many threads torch uses, and how they wait, decided in one place for every entry point
(docs/threads.md): passive OpenMP waiting set before torch loads (`set_wait_policy`, through
`rollout.cpu.configure()`), one thread for a model too small to amortise a wake-up per parallel
region (SMALL_MODEL_PARAMS), else the cores this process may use less those other programs keep
busy (`CoreWatch`); engine and trainer each set their own count while they run (`using`).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

SMALL_MODEL_PARAMS = 4_000_000
_USER_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_announced: set = set()


def set_wait_policy() -> None:
    """Passive OpenMP waiting, unless the user chose a policy (only before torch is imported)."""
    if any(v in os.environ for v in _USER_WAIT_VARS) or "torch" in sys.modules:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def worker_env() -> dict:
    """The OpenMP wait settings for a process this one starts (a Ray worker): the user's, else passive."""
    chosen = {v: os.environ[v] for v in _USER_WAIT_VARS if v in os.environ}
    return chosen or {"OMP_WAIT_POLICY": "PASSIVE"}


def wait_policy() -> str:
    """What OpenMP waits with in this process, for the start-up line."""
    for v in _USER_WAIT_VARS:
        if v in os.environ:
            return f"{v}={os.environ[v]}"
    return ("OpenMP default (spinning: set OMP_WAIT_POLICY=PASSIVE, or call rollout.cpu.configure() "
            "before importing torch)")


def usable_cores() -> int:
    """The cores this process may use: its affinity, the cgroup's quota, OMP_NUM_THREADS (Ray's num_cpus)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, quota)
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        cores = min(cores, int(omp))
    return max(1, cores)


def _cgroup_quota() -> Optional[int]:
    """ceil(quota / period) of the cgroup's CPU limit (v2 cpu.max, v1 cfs files), None if unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota, period = (int(Path(f"/sys/fs/cgroup/cpu/cpu.cfs_{n}_us").read_text()) for n in ("quota", "period"))
        return max(1, math.ceil(quota / period)) if quota > 0 else None
    except (OSError, ValueError):
        return None


def engine_threads(requested: Optional[int], params_per_token: int) -> int:
    """An engine's threads on the CPU: as requested, else 1 for a small model, else every usable core."""
    if requested:
        return int(requested)
    return 1 if params_per_token < SMALL_MODEL_PARAMS else usable_cores()


@dataclass
class CoreWatch:
    """How many of this process's cores other programs keep busy, from /proc/stat: their busy time
    since the last look, less this process's own CPU time, over the wall time between the looks."""

    cores: tuple
    last: Optional[tuple] = None  # (wall s, busy core-seconds of `cores`, own CPU s)
    chosen: Optional[int] = None

    MIN_WINDOW_S = 0.5  # shorter windows hold too few clock ticks: the last choice stands
    FIRST_LOOK_S = 0.1

    @classmethod
    def of_this_process(cls) -> Optional[CoreWatch]:
        """None where /proc/stat is not readable (not Linux)."""
        try:
            cores = tuple(sorted(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return None
        watch = cls(cores)
        return watch if watch._look() is not None else None

    def threads(self, most: int) -> int:
        """Threads for the next run: one per core other programs left free (rounded), 1 to most."""
        now = self._look()
        if now is None:
            return most
        if self.last is None:
            time.sleep(self.FIRST_LOOK_S)
            self.last, now = now, self._look()
        wall = now[0] - self.last[0]
        if wall < self.MIN_WINDOW_S and self.chosen is not None:
            return self.chosen
        others = max(0.0, (now[1] - self.last[1]) - (now[2] - self.last[2])) / max(wall, 1e-9)
        self.last = now
        self.chosen = free_threads(len(self.cores), others, most)
        return self.chosen

    def _look(self) -> Optional[tuple]:
        busy = _busy_core_seconds(self.cores)
        return None if busy is None else (time.monotonic(), busy, time.process_time())


def free_threads(cores: int, others_busy: float, most: int) -> int:
    """The cores other programs left free, rounded, from 1 to `most`."""
    return max(1, min(most, math.floor(cores - others_busy + 0.5)))


def _busy_core_seconds(cores: tuple) -> Optional[float]:
    """Seconds the given CPUs spent not idle (user, nice, system, irq, softirq, steal) since boot."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted, ticks = {f"cpu{c}" for c in cores}, 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


def trainer_threads(requested: Optional[int]) -> int:
    return int(requested) if requested else usable_cores()


@contextlib.contextmanager
def using(num_threads: Optional[int]) -> Iterator[None]:
    """torch uses num_threads intra-op threads inside the block (None: leave it alone)."""
    import torch

    if not num_threads:
        yield
        return
    before = torch.get_num_threads()
    if before != num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def announce(line: str) -> None:
    """Print a threading decision once per process (stderr, so it stays out of piped results)."""
    if line not in _announced:
        _announced.add(line)
        print(f"spectail: {line}; waiting: {wait_policy()}", file=sys.stderr, flush=True)
