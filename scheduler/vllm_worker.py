"""The Ray worker that holds a vLLM engine instead of spectail's, behind the same chunk protocol
(scheduler/worker.py), so the scheduler's divided rollout, balancing and recovery run unchanged.

A continued chunk is prefilled again, cheaply where vLLM's prefix cache holds it (group affinity
keeps it on the worker that ran it), and draws fresh noise (rollout/vllm_backend/backend.py, `chunk_seed`):
a request's tokens depend on where its chunks ended (docs/guarantees.md). The actor runs the
Python that has vLLM (`make venv-vllm`) through Ray's runtime_env `py_executable`; that Python
needs the driver's Ray version, which `actor_options` checks. Results carry prefix_cached_tokens.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from rollout import EngineConfig
from rollout.core.request import Request
from rollout.vllm_backend.config import VllmConfig

from .rollout_scheduler import WorkerLost
from .worker import by_budget, chunk_results

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


class VllmRolloutWorker:
    """A VllmBackend behind a Ray actor, with RolloutWorker's methods (ping, update_weights,
    run_chunk). Built by the backend as ray.remote(VllmRolloutWorker).options(...)."""

    def __init__(self, source, engine_config: EngineConfig, index: int = 0, vllm: VllmConfig = VllmConfig()):
        from rollout.vllm_backend import VllmBackend

        self.index = index
        # Ray sets OMP_NUM_THREADS to the actor's CPUs (ray_backend.WorkerPool); workers of one node
        # are bound to different cores (by index), as Ray does not pin CPUs itself
        threads = engine_config.num_threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None
        config = dataclasses.replace(engine_config, num_threads=threads)
        self.backend = VllmBackend(source, config, vllm, cpu_offset=index * (threads or 1))
        self.busy_s = 0.0
        self.chunks = 0
        self.lost: Optional[str] = None  # why this worker can run nothing more (its engine died)

    def ping(self) -> dict:
        cfg = self.backend.config
        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname(), "engine": "vllm",
                "vocab_size": self.backend.vocab_size, "max_batch_size": cfg.max_batch_size,
                "max_model_len": cfg.max_model_len, "device": cfg.device, "num_threads": cfg.num_threads,
                "startup_seconds": self.backend.startup_seconds, "busy_s": self.busy_s, "chunks": self.chunks}

    def update_weights(self, weights) -> int:
        """weights: a state dict (Ray resolves the ObjectRef the backend passes). All or nothing."""
        return self._guarded(self.backend.update_weights, weights)

    def run_chunk(self, work: list[dict], drafter=None) -> list[dict]:
        """drafter: ignored (spectail's proposers do not run inside vLLM)."""
        return self._guarded(self._run_chunk, work)

    def _guarded(self, fn, *args):
        """fn(*args), its errors a ValueError or a RuntimeError the driver reads without vLLM. A dead vLLM
        engine makes this worker lost: WorkerLost now and at every later call, so the scheduler replaces it."""
        if self.lost is not None:
            raise WorkerLost(self.lost)
        try:
            return fn(*args)
        except ValueError as e:
            raise ValueError(str(e)) from None
        except Exception as e:  # noqa: BLE001 -- re-raised as a type every Python can deserialise
            from vllm.v1.engine.exceptions import EngineDeadError

            from rollout.vllm_backend import engine_exit

            if isinstance(e, EngineDeadError):
                how = engine_exit(self.backend.llm) if self.backend.llm is not None else "shut down"
                self.lost = f"vLLM worker {self.index}: its vLLM engine died ({how}); this worker is lost"
                with contextlib.suppress(Exception):
                    self.backend.shutdown()
                raise WorkerLost(self.lost) from None
            raise RuntimeError(f"vLLM worker {self.index}: {type(e).__name__}: {e}") from None

    def _run_chunk(self, work: list[dict]) -> list[dict]:
        t0 = time.perf_counter()
        results, steps, fed, cached = [], 0, 0, 0
        for budget, items in by_budget(work).items():
            part, info = self._run(items, budget, time.perf_counter() - t0)
            results += part
            steps, fed, cached = steps + info.engine_steps, fed + info.fed_tokens, cached + info.cached_tokens
        wall = time.perf_counter() - t0
        for r in results:
            r.update(wall_s=wall, engine_steps=steps, fed_tokens=fed, spec_off_steps=0, prefix_cached_tokens=cached)
        self.busy_s += wall
        self.chunks += 1
        return results

    def _run(self, items: list[dict], budget: Optional[int], offset: float):
        b = self.backend
        reqs = [Request.from_wire(w["request"], b.vocab_size, b.config.max_model_len, index=i)
                for i, w in enumerate(items)]
        starts = [len(r.output_ids) for r in reqs]
        info = b.run(reqs, max_new_tokens=budget)
        return chunk_results(reqs, items, starts, lambda i: offset + info.finished_at.get(i, info.seconds)), info


# ---- which Python the actors run ----------------------------------------------------------------

def worker_python(vllm: VllmConfig) -> str:
    """The interpreter for vLLM actors: VllmConfig.python, else this one when it has vLLM, else
    the repository's .venv-vllm (ValueError where there is none)."""
    if vllm.python:
        return vllm.python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if VENV_PYTHON.exists():
        return str(VENV_PYTHON)
    raise ValueError("rollout.name=vllm on Ray workers needs a Python with vLLM: `make venv-vllm` creates "
                     f"{VENV_PYTHON} (or set rollout.vllm.python to one on every node)")


def check_python(python: str, timeout_s: float = 120.0) -> None:
    """ValueError unless `python` runs, imports vLLM and has this Ray and this Python version."""
    import ray

    probe = ("import importlib.util, json, sys, ray; print(json.dumps({'ray': ray.__version__, "
             "'vllm': importlib.util.find_spec('vllm') is not None, 'python': list(sys.version_info[:2])}))")
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"the vLLM workers' Python {python!r} does not run ({e}); `make venv-vllm` creates one") \
            from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"the vLLM workers' Python {python!r} cannot import Ray ({last}); `make venv-vllm` "
                         f"installs ray=={ray.__version__} there")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if not found["vllm"]:
        raise ValueError(f"the vLLM workers' Python {python!r} has no vLLM; `make venv-vllm` creates one that has")
    if found["ray"] != ray.__version__ or found["python"] != list(sys.version_info[:2]):
        raise ValueError(f"the vLLM workers' Python {python!r} has Ray {found['ray']} on Python "
                         f"{'.'.join(map(str, found['python']))}, this driver Ray {ray.__version__} on Python "
                         f"{sys.version_info[0]}.{sys.version_info[1]}: a Ray cluster needs one of each "
                         f"(`make venv-vllm RAY_VERSION={ray.__version__}`)")


def actor_options(vllm: VllmConfig) -> dict:
    """Ray actor options: runtime_env py_executable when the workers' Python is not this one."""
    python = worker_python(vllm)
    # (not realpath: every venv's python links to the same interpreter, with other site-packages)
    if os.path.abspath(python) == os.path.abspath(sys.executable) and importlib.util.find_spec("vllm"):
        return {}
    check_python(python)
    return {"runtime_env": {"py_executable": python}}


def ray_options(vllm: VllmConfig) -> dict:
    """RayRolloutBackend's keyword arguments for vLLM workers."""
    return {"worker_cls": VllmRolloutWorker, "worker_kwargs": {"vllm": vllm}, "actor_options": actor_options(vllm)}
