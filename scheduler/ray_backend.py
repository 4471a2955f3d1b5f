"""Rollouts on Ray workers, with the same contract as `Engine.generate` (docs/cluster.md).

    backend = RayRolloutBackend("ckpt/", EngineConfig(max_batch_size=32), num_workers=4)
    outs = backend.generate(prompt_ids, SamplingParams(max_tokens=512), seeds=seeds, groups=groups)
    backend.update_weights(model)          # after each optimizer step: one ray.put, every worker

Ray: `address`, else RAY_ADDRESS (which `ray job submit` sets), else the connection of a driver
that already called `ray.init`, else a local Ray (stopped by `shutdown`). A cluster address is
probed with a TCP connection first: a dead one fails in seconds, not after minutes of retries.
In-memory weights go into the object store once, and every worker reads that copy.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import time
from typing import Callable, Optional, Sequence

import torch

from rollout import Completion, EngineConfig, SamplingParams, cpu
from rollout.core.request import make_requests

from .drafter_slices import DrafterSlices
from .rollout_scheduler import RolloutScheduler, SchedulerConfig
from .worker import RolloutWorker


def _ray():
    try:
        import ray
    except ImportError:  # pragma: no cover -- depends on the install
        raise ImportError("RayRolloutBackend needs Ray: pip install 'spectail[ray]'") from None
    return ray


# ---- connecting ------------------------------------------------------------------------------

def _host_port(address: str) -> Optional[tuple[str, int]]:
    """host and port of a GCS ("host:port") or Ray Client ("ray://host:port") address."""
    a, default = address.strip(), 6379
    if a.startswith("ray://"):
        a, default = a[len("ray://"):], 10001
    elif "://" in a or a in ("auto", "local", ""):
        return None  # resolved by Ray itself
    host, sep, port = a.rpartition(":")
    if not sep:
        return a, default
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"Ray address {address!r} is not host:port") from None


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast (ConnectionError) when nothing listens at a cluster address."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(
            f"cannot reach a Ray cluster at {address!r}: {e}. Is `ray start --head` running there, "
            "and is the address the head's GCS host:port (default port 6379; ray:// addresses "
            "use the Ray Client port, default 10001)?") from None


def connect(address: Optional[str] = None, num_cpus: Optional[int] = None,
            timeout_s: float = 5.0) -> bool:
    """Connect to (or start) Ray. Returns True when this call started a local Ray."""
    ray = _ray()
    if address is not None:
        check_reachable(address, timeout_s)
    if ray.is_initialized():
        return False  # e.g. the driver of a Ray job: use its connection
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        check_reachable(address, timeout_s)
    if address is not None:
        ray.init(address=address)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    return True


# ---- the workers -----------------------------------------------------------------------------

def model_payload(source):
    """A model source in the form workers receive it: a path stays a path; in-memory weights
    become one ObjectRef of a (config, CPU state dict) pair."""
    ray = _ray()
    if isinstance(source, ray.ObjectRef):
        return source
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    if isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        return ray.put((source.config, _cpu_state_dict(source)))
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], dict):
        return ray.put((source[0], _cpu_state_dict(source[1])))
    raise ValueError("model_source must be a checkpoint folder path, a transformers model, a "
                     f"(Hugging Face config, state dict) pair or an ObjectRef of one, got {type(source).__name__}")


def _cpu_state_dict(weights) -> dict:
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    items = weights.items() if isinstance(weights, dict) else weights
    return {str(k): v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in items}


def _start_error(index: int, e: BaseException) -> RuntimeError:
    """The worker's own constructor error (its last traceback line), not Ray's wrapping of it."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", getattr(e, "error_msg", None) or str(e))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    root = next((ln for ln in reversed(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception)\b.*:", ln)),
                lines[-1] if lines else repr(e))
    return RuntimeError(f"rollout worker {index} failed to start: {root}")


class WorkerPool:
    """The actors, their readiness, replacement after a loss, and the current weights."""

    def __init__(self, payload, engine_config: EngineConfig, num_workers: int, num_cpus: float,
                 num_gpus: float, start_timeout_s: float, restart: bool, max_restarts: int,
                 actor_options: Optional[dict] = None, worker_cls=None, worker_kwargs: Optional[dict] = None):
        self.payload, self.engine_config = payload, engine_config
        # the actor class: spectail's engine, or another engine behind the same chunk protocol
        # (scheduler/vllm_worker.py), built as worker_cls(payload, engine_config, index, **worker_kwargs)
        self.worker_cls, self.worker_kwargs = worker_cls or RolloutWorker, dict(worker_kwargs or {})
        self.options = {"num_cpus": num_cpus, "num_gpus": num_gpus, **(actor_options or {})}
        # OpenMP reads its wait policy and thread count when torch loads, oneDNN its cap at its first
        # kernel: they must be in the worker's environment from the start (rollout/cpu.py); the
        # user's variables win.
        runtime_env = dict(self.options.get("runtime_env") or {})
        cores = {"OMP_NUM_THREADS": str(max(1, int(num_cpus)))} if engine_config.device == "cpu" else {}
        runtime_env["env_vars"] = {**cpu.worker_env(), **cores, **(runtime_env.get("env_vars") or {})}
        self.options["runtime_env"] = runtime_env
        self.start_timeout_s, self.restart = start_timeout_s, restart
        self.max_restarts = self.restarts_left = max_restarts  # replacements per rollout
        self.num_slots = num_workers
        self.actors: dict[int, object] = {}
        self.info: dict[int, dict] = {}
        self._starting: dict = {}  # ping ref -> (index, actor, since)
        self.weights_ref = None
        self.last_error: Optional[str] = None
        for i in range(num_workers):
            self._spawn(i)
        self._wait_started()

    def _spawn(self, i: int) -> None:
        ray = _ray()
        # A worker class that trains in its own concurrency group declares it (scheduler/worker.py);
        # groups can only be declared here, not in .options() (ray/actor.py, ActorClass.options).
        groups = getattr(self.worker_cls, "concurrency_groups", None)
        cls = ray.remote(concurrency_groups=groups)(self.worker_cls) if groups else ray.remote(self.worker_cls)
        actor = cls.options(**self.options).remote(self.payload, self.engine_config, i, **self.worker_kwargs)
        if self.weights_ref is not None:
            actor.update_weights.remote(self.weights_ref)  # calls run in order: after the constructor
        self._starting[actor.ping.remote()] = (i, actor, time.perf_counter())

    def _wait_started(self) -> None:
        """Block until every worker answers (first start): surface its error or a timeout."""
        ray = _ray()
        deadline = time.perf_counter() + self.start_timeout_s
        while self._starting:
            for ref in self._answered(deadline):
                self.started(ref, first=True)
            if self._starting and time.perf_counter() >= deadline:
                waiting = sorted(i for i, _, _ in self._starting.values())
                self.kill_all()
                raise TimeoutError(
                    f"rollout workers {waiting} were not ready within start_timeout_s={self.start_timeout_s}: "
                    f"each asks for {self.options}; the cluster has {ray.available_resources()} free "
                    f"of {ray.cluster_resources()} (a worker that cannot be placed waits forever)")
        sizes = {inf["vocab_size"] for inf in self.info.values()}
        if len(sizes) > 1:
            self.kill_all()
            raise ValueError(f"workers loaded models with different vocabularies: {sizes}")

    # -- what the scheduler uses --

    def ready(self) -> list[int]:
        return sorted(self.actors)

    def max_batch(self, i: int) -> int:
        return self.info[i]["max_batch_size"]

    def submit(self, i: int, work: list[dict], drafter: Optional[tuple] = None):
        """drafter: (version, [ObjectRef]) of the newest draft head, loaded before the chunk."""
        return self.actors[i].run_chunk.remote(work, drafter)

    def train_drafter(self, i: int, seconds: float, drafter: Optional[tuple] = None):
        """A training slice of the draft head on worker i (scheduler/drafter_slices.py), in the
        worker's own concurrency group: a chunk sent meanwhile does not queue behind it."""
        from .worker import DRAFTER_GROUP

        return self.actors[i].train_drafter.options(concurrency_group=DRAFTER_GROUP).remote(seconds, drafter)

    def stop_drafter(self, i: int):
        """End worker i's training slice at its next optimizer step (in the default group)."""
        return self.actors[i].stop_drafter_slice.remote()

    def starting(self) -> dict:
        """Replacements still starting ({ping ref: index}); those past start_timeout_s are dropped."""
        for ref, (i, actor, since) in list(self._starting.items()):
            if time.perf_counter() - since > self.start_timeout_s:
                del self._starting[ref]
                self.last_error = f"replacement worker {i} did not start within {self.start_timeout_s}s"
                self._kill(actor)
        return {ref: i for ref, (i, _, _) in self._starting.items()}

    def started(self, ref, first: bool = False) -> None:
        """A worker answered its ping (or failed to start). first: the pool's first start, where a
        failure stops everything; a replacement that cannot start is given up."""
        if ref not in self._starting:
            return  # (expired meanwhile)
        i, actor, _ = self._starting.pop(ref)
        try:
            self.info[i] = _ray().get(ref, timeout=30)
            self.actors[i] = actor
        except Exception as e:  # noqa: BLE001
            if first:
                self.kill_all()
                raise _start_error(i, e) from None
            self.last_error = str(_start_error(i, e))
            self._kill(actor)

    def await_starting(self, timeout_s: float) -> int:
        """Wait up to timeout_s for replacements still starting; returns the live worker count."""
        deadline = time.perf_counter() + timeout_s
        while self.starting():
            for ref in self._answered(deadline):
                self.started(ref)
            if time.perf_counter() >= deadline:
                break
        return len(self.actors)

    def _answered(self, deadline: float) -> list:
        """The pings of starting workers that answer within a second (or by the deadline)."""
        left = deadline - time.perf_counter()
        return _ray().wait(list(self._starting), num_returns=1, timeout=max(0.0, min(left, 1.0)))[0]

    def fail(self, i: int, error: BaseException) -> None:
        self.last_error = f"worker {i}: {type(error).__name__}: {error}"
        actor = self.actors.pop(i, None)
        if actor is not None:
            self._kill(actor)
        if self.restart and self.restarts_left > 0:
            self.restarts_left -= 1
            self._spawn(i)

    # -- weights and teardown --

    def update_weights(self, ref, timeout_s: float) -> None:
        ray = _ray()
        calls = {a.update_weights.remote(ref): i for i, a in self.actors.items()}
        for _, actor, _ in self._starting.values():
            actor.update_weights.remote(ref)  # runs right after its constructor
        ready, not_ready = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        lost = []
        for r in ready:
            try:
                ray.get(r, timeout=30)
            except Exception as e:  # noqa: BLE001
                from .rollout_scheduler import _is_worker_loss

                if not _is_worker_loss(e):
                    raise  # e.g. ValueError from load_weights: nothing was changed anywhere
                lost.append((calls[r], e))
        for r in not_ready:
            lost.append((calls[r], TimeoutError(f"update_weights took over {timeout_s}s")))
        self.weights_ref = ref  # replacements load these
        for i, e in lost:
            self.fail(i, e)

    def _kill(self, actor) -> None:
        try:
            _ray().kill(actor)
        except Exception:  # noqa: BLE001 -- already gone
            pass

    def kill_all(self) -> None:
        for actor in list(self.actors.values()) + [a for _, a, _ in self._starting.values()]:
            self._kill(actor)
        self.actors.clear()
        self._starting.clear()


# ---- the backend -----------------------------------------------------------------------------

def default_kept_slots(engine_config: EngineConfig, mode: str, kept_slots: Optional[int] = None) -> int:
    """The kept KV slots of a worker's engine: `kept_slots`, else a nonzero EngineConfig.kept_slots,
    else in the divided modes two batches on a CPU (what runs, and what longer requests displaced:
    one batch would evict those and prefill them again) and one elsewhere (KV memory bounds the
    batch); the static split keeps none."""
    if kept_slots is not None:
        if isinstance(kept_slots, bool) or not isinstance(kept_slots, int) or kept_slots < 0:
            raise ValueError(f"kept_slots must be None or an integer >= 0, got {kept_slots!r}")
        return kept_slots
    if engine_config.kept_slots or mode == "static":
        return engine_config.kept_slots
    batch = engine_config.max_batch_size
    return 2 * batch if torch.device(engine_config.device).type == "cpu" else batch


def _scheduler_knob(name: str) -> property:
    """A SchedulerConfig field as a backend attribute, checked when set (between rollouts)."""
    def set_knob(self, value) -> None:
        SchedulerConfig(**{name: value}).validate()
        setattr(self.scheduler_config, name, value)
    return property(lambda self: getattr(self.scheduler_config, name), set_knob)


class RayRolloutBackend:
    """Engine.generate's contract, run by `num_workers` RolloutWorker actors.

    model_source: a checkpoint folder (on every worker's node), a transformers model, a (Hugging
        Face config, state dict) pair, or an ObjectRef of such a pair.
    engine_config: each worker's engine (its max_batch_size: the most requests a worker batches).
    num_cpus_per_worker / num_gpus_per_worker: the actors' Ray resources (a CPU worker uses that
        many torch threads).
    chunk_tokens, chunk_growth, mode: the scheduler's (rollout_scheduler.py); `mode` and
        `chunk_tokens` may change between rollouts, `scheduler_config` holds the rest.
    kept_slots: KV slots each worker keeps for the requests it paused (default_kept_slots).
    on_idle(worker) / on_chunk(worker, results): called when a worker has no work / returns a chunk.
    restart_workers / max_restarts: replace a dead worker, at most max_restarts per rollout.
    start_timeout_s, call_timeout_s (update_weights), chunk_timeout_s (a chunk not back by then
        counts as a dead worker), connect_timeout_s (the probe of a cluster address).
    actor_options: extra Ray actor options; worker_cls, worker_kwargs: the actor class and its
        extra arguments (scheduler/vllm_worker.py's VllmRolloutWorker holds vLLM).
    """

    def __init__(self, model_source, engine_config: EngineConfig = EngineConfig(), num_workers: int = 1,
                 num_cpus_per_worker: float = 1, num_gpus_per_worker: float = 0,
                 chunk_tokens: int = SchedulerConfig.chunk_tokens, mode: str = "divided+context",
                 address: Optional[str] = None,
                 start_timeout_s: float = 300.0, on_idle: Optional[Callable[[int], None]] = None, *,
                 chunk_growth: float = 1.0, on_chunk: Optional[Callable[[int, list], None]] = None,
                 restart_workers: bool = True,
                 max_restarts: int = 4, call_timeout_s: float = 600.0, chunk_timeout_s: float = 3600.0,
                 connect_timeout_s: float = 5.0, actor_options: Optional[dict] = None,
                 worker_cls=None, worker_kwargs: Optional[dict] = None, kept_slots: Optional[int] = None):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        if not num_cpus_per_worker >= 0 or not num_gpus_per_worker >= 0:
            raise ValueError("num_cpus_per_worker and num_gpus_per_worker must be >= 0")
        if not start_timeout_s > 0 or not call_timeout_s > 0:
            raise ValueError("start_timeout_s and call_timeout_s must be > 0")
        engine_config.validate()
        if worker_cls is None:
            engine_config = dataclasses.replace(engine_config,
                                                kept_slots=default_kept_slots(engine_config, mode, kept_slots))
        self.scheduler_config = SchedulerConfig(mode=mode, chunk_tokens=chunk_tokens, chunk_growth=chunk_growth,
                                                chunk_timeout_s=chunk_timeout_s)
        self.scheduler_config.validate()
        self.engine_config, self.num_workers = engine_config, num_workers
        self.on_idle, self.on_chunk = on_idle, on_chunk
        self.call_timeout_s = call_timeout_s
        self._metrics: dict = {}
        self._rollouts = 0
        self._pool = None
        self._started_ray = connect(address, num_cpus=max(os.cpu_count() or 1,
                                                          math.ceil(num_workers * num_cpus_per_worker)),
                                    timeout_s=connect_timeout_s)
        try:
            self._payload = model_payload(model_source)
            self._pool = WorkerPool(self._payload, engine_config, num_workers, num_cpus_per_worker,
                                    num_gpus_per_worker, start_timeout_s, restart_workers, max_restarts,
                                    actor_options, worker_cls, worker_kwargs)
        except BaseException:
            self.shutdown()
            raise
        self.vocab_size = next(iter(self._pool.info.values()))["vocab_size"]
        self._engine_config = engine_config
        spec = engine_config.spec
        self._drafter = (DrafterSlices(spec.drafter.idle_slice_s) if spec is not None and "drafter" in spec.proposers
                         and spec.drafter.idle_slice_s is not None else None)

    # -- scheduling knobs, changeable between rollouts --

    mode = _scheduler_knob("mode")
    chunk_tokens = _scheduler_knob("chunk_tokens")

    @property
    def idle_training_s(self) -> Optional[float]:
        """The drafter's training slice on idle workers (None: no training); changeable between
        rollouts (spec.drafter.idle_slice_s sets it at start)."""
        return self._drafter.slice_s if self._drafter is not None else None

    @idle_training_s.setter
    def idle_training_s(self, value: Optional[float]) -> None:
        if value is not None and not value > 0:
            raise ValueError(f"idle_training_s must be None or > 0, got {value!r}")
        if self._drafter is None:
            self._drafter = DrafterSlices(None)
        self._drafter.slice_s = value

    @property
    def workers(self) -> dict:
        """Live actor handles by worker index (read-only view; for tests and tools)."""
        return dict(self._pool.actors) if self._pool else {}

    @property
    def worker_info(self) -> dict:
        return dict(self._pool.info) if self._pool else {}

    # -- the contract --

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seeds: Optional[Sequence[int]] = None,
                 drafts: Optional[Sequence[Optional[Sequence[int]]]] = None,
                 groups: Optional[Sequence[Optional[int]]] = None,
                 draft_logprobs: Optional[Sequence[Optional[Sequence[float]]]] = None) -> list[Completion]:
        """Same contract as Engine.generate; input is validated here, before any work is sent."""
        self._check_open()
        requests = make_requests(self.vocab_size, self._engine_config.max_model_len, prompt_token_ids,
                                 sampling_params, seeds, drafts, groups, draft_logprobs=draft_logprobs)
        if not requests:
            self._metrics = {}
            return []
        self._pool.await_starting(0)  # replacements that came up since the last rollout join now
        self._pool.restarts_left = self._pool.max_restarts
        self._rollouts += 1
        sched = RolloutScheduler(self._pool, self.scheduler_config, on_idle=self.on_idle, on_chunk=self.on_chunk,
                                 drafter=self._drafter)
        self._metrics = sched.run(requests, rollout_id=self._rollouts)
        return [r.completion() for r in requests]

    def update_weights(self, state_dict_or_module) -> None:
        """Put the weights in the object store once; every worker loads that copy (all or nothing
        per worker: a bad name or shape raises ValueError and changes nothing)."""
        self._check_open()
        ref = _ray().put(_cpu_state_dict(state_dict_or_module))
        self._pool.update_weights(ref, self.call_timeout_s)

    def metrics(self) -> dict:
        """The scheduler's figures of the last generate (see rollout_scheduler's docstring)."""
        return dict(self._metrics)

    def drafter_metrics(self) -> dict:
        """The draft head's figures of the last generate: its seconds inside chunks and, when
        idle workers train it, drafter_train_steps / _seconds / _slices / _version."""
        return {k: v for k, v in self._metrics.items() if k.startswith("drafter")}

    def publish_drafter(self, state: dict, version: int) -> None:
        """Send a draft head (drafter.export.head_state) to every worker with its next chunk, as
        an idle-time training slice does; a worker where it does not load drafts without it."""
        self._check_open()
        if self._drafter is None:
            self._drafter = DrafterSlices(None)  # publishes, never trains
        self._drafter.published = (int(version), [_ray().put(state)])

    def published_drafter(self, timeout_s: Optional[float] = None) -> Optional[tuple]:
        """(version, drafter.export.head_state) of the newest draft head published to the workers
        (by an idle slice or publish_drafter), after waiting up to timeout_s (None: two slices
        and 10 s) for slices still in flight; None when none was. What a checkpoint saves."""
        self._check_open()
        if self._drafter is None:
            return None
        wait = timeout_s if timeout_s is not None else 10.0 + 2 * (self._drafter.slice_s or 0.0)
        return self._drafter.latest(wait)

    def wait_ready(self, timeout_s: float = 300.0) -> int:
        """Wait (at most timeout_s) for replacement workers still starting; returns how many
        workers are live."""
        self._check_open()
        return self._pool.await_starting(timeout_s)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.kill_all()
            self._pool = None
        if self._started_ray:
            self._started_ray = False
            _ray().shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def _check_open(self) -> None:
        if self._pool is None:
            raise RuntimeError("this RayRolloutBackend was shut down")
