"""How many threads torch uses, and how they wait: decided in one place for every entry point.

torch's CPU kernels run on an OpenMP pool. By default its threads spin at the end of every
parallel region waiting for their siblings. On a machine where another program holds a core,
the sibling is often descheduled, so the spinning thread burns its whole time slice waiting,
at every op: a small model (where every op is a parallel region) then runs tens of times
slower with 2 threads than with 1. Three choices fix that:

- the wait policy. `OMP_WAIT_POLICY=PASSIVE` makes waiting threads sleep. OpenMP reads it
  once, when torch loads it, so `set_wait_policy` must run before torch is imported: spectail's
  command line does so (`rollout.cpu.configure()`; importing spectail sets nothing), unless the
  user set a policy of their own (OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME). Ray workers
  get it in their environment (scheduler/ray_backend.py).
- the thread count. A passive wait costs a wake-up per parallel region, which a small
  model's tiny ops cannot amortise: below `SMALL_MODEL_PARAMS` parameters per token an
  engine uses one thread (measured: `python -m benchmarks.bench --busy`, bench_results/threads.json),
  above it the cores this process may use (affinity, cgroup quota and OMP_NUM_THREADS, which
  Ray sets to an actor's num_cpus), unless one thread ran a decode-shaped forward faster when
  the engine was built (`Engine._fastest_threads`: virtual CPUs may share a physical core). The
  engine and the trainer take turns in one process, so each sets its own count while it runs
  (`using`).
- cores other programs hold. Beside a program that keeps a core busy, a second thread waits
  for its descheduled sibling at every parallel region, which costs more than the split saves.
  So an engine that chose its own count takes, at the start of each run, one thread per core
  that other programs left free over the time since its previous run (`CoreWatch`).

Overrides: EngineConfig.num_threads (rollout.engine.num_threads in a run config: a fixed count),
trainer.num_threads, and the OpenMP variables above.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Optional

# A model whose matmuls per token are smaller than this gains nothing from a second thread
# with passive waiting (the wake-ups cost more than the split saves).
SMALL_MODEL_PARAMS = 4_000_000
_USER_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_announced: set = set()


def set_wait_policy() -> None:
    """Passive OpenMP waiting, unless the user chose a policy. Has effect only before torch is
    imported (OpenMP reads it when it loads); `wait_policy()` says what is in force."""
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
    """The cores this process may use: its CPU affinity, the cgroup's CPU quota, and
    OMP_NUM_THREADS when set (Ray sets it to an actor's num_cpus)."""
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
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return max(1, math.ceil(quota / period)) if quota > 0 else None
    except (OSError, ValueError):
        return None


def engine_threads(requested: Optional[int], params_per_token: int) -> int:
    """The intra-op threads of an engine on the CPU: as requested, else 1 for a small model,
    else every usable core."""
    if requested:
        return int(requested)
    return 1 if params_per_token < SMALL_MODEL_PARAMS else usable_cores()


@dataclass
class CoreWatch:
    """How many of this process's cores other programs keep busy, from /proc/stat: the busy time
    of those cores since the last look, less this process's own CPU time (so an engine's own run
    does not count against it), over the wall time between the looks."""

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
    """Threads for `cores` cores of which other programs keep `others_busy` busy: the free ones,
    rounded to the nearest whole core, at least 1 and at most `most`."""
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
