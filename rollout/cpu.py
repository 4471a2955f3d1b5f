"""The process-wide CPU settings spectail wants, applied only when asked: `configure()`.

Two settings concern the whole process, so importing spectail changes neither:

- OpenMP's wait policy, passive (rollout/core/threads.py): waiting threads sleep instead of spinning,
  which matters where other programs share the cores. OpenMP reads it once, when torch loads it.
- oneDNN capped below AMX (rollout/kernels/cpu_isa.py): torch's own bfloat16 matmuls then give a row the
  same bits whatever the call's row count. oneDNN reads it once, when it makes its first kernel.
  It slows every bfloat16 matmul of the process (a trainer's too) several times on an AMX CPU.

spectail calls `configure()` where it owns the process: its command line (rl_integration/cli.py)
and its Ray workers (scheduler/worker.py, and their environment: scheduler/ray_backend.py). A
library user may call it first thing, before importing torch; it is optional. Without it the
engine stays exact: its bfloat16 linear layers on an AMX CPU run through spectail's own tile
kernel (rollout/kernels/amx_linear.py), and an engine whose layers would go through an uncapped oneDNN
on AMX warns (`cpu_isa.check`).
"""
from __future__ import annotations

import os

from .core import threads
from .kernels import cpu_isa

# torch is not imported here: configure() must be able to run before torch loads OpenMP.
VARIABLES = ("OMP_WAIT_POLICY", *cpu_isa.ISA_VARS)


def configure() -> dict:
    """Set passive OpenMP waiting (if torch is not loaded yet) and the oneDNN cap, each unless the
    user chose a setting of their own. Returns the environment variables it set."""
    before = {v: os.environ.get(v) for v in VARIABLES}
    threads.set_wait_policy()
    cpu_isa.cap_isa()
    return {v: os.environ[v] for v in VARIABLES if os.environ.get(v) != before[v]}


def worker_env() -> dict:
    """The variables a spectail worker process starts with (a Ray actor running the engine): the
    user's wait policy and cap where set, else passive waiting and the cap."""
    chosen = {v: os.environ[v] for v in cpu_isa.ISA_VARS if v in os.environ}
    return {**threads.worker_env(), **(chosen or {cpu_isa.ISA_VARS[0]: cpu_isa.CAP})}
