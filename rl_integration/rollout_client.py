"""RolloutClient: what a trainer calls to get rollouts, over any RolloutBackend (in-process
engine, Ray workers, vLLM): n samples per prompt with a group index, every sample's seed,
history reuse across steps, and per-call / per-step metrics.

    client = RolloutClient(cfg.rollout, model_or_folder, seed=0, stop_token_ids=[eos])
    batch = client.generate(prompts, n=8)          # RolloutBatch, one row per sample
    client.record_rewards(batch, rewards)          # reward_mean, and rewards into the history
    client.update_weights(model)                   # after the step's optimizer updates
    metrics = client.end_step()                    # the step's aggregate; history written; step += 1

Seeds: sample s of prompt p gets `sample_seed(run seed, key(p), s, step)`; with
noise="per_sample" the step is left out, which makes history reuse accept far more but trains
the weights on the same draws (docs/noise-study.md; train() warns). History: with the "history"
proposer each sample drafts from the newest stored response to the same (prompt, sample index)
(scheduler/history_store.py); the engine verifies every token, so drafts only cost or save
forwards. Each prompt of a call is a fresh group, so the "suffix" proposer lets siblings draft
for each other. The lenient mode (spec.lenience) is biased: it reports `lenient_tokens`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from rollout.core.seeds import prompt_key, sample_seed
from scheduler.history_store import HistoryRecord, HistoryStore

from . import metrics as M
from .config import RolloutSection, RunConfig, plain_engine


@dataclass
class RolloutBatch:
    """One rollout step, one row per sample (prompt-major: the n samples of prompt 0 first)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]  # behaviour logprobs: the engine's, of each completion token
    seeds: list[int]
    group_index: list[int]  # which prompt of the call (0 .. num_prompts - 1)
    sample_index: list[int]  # which sample of its prompt (0 .. n - 1; n .. 2n - 1 for its 2nd group in a call, ...)
    finish_reasons: list[str]
    sample_stats: list[dict]  # engine stats per sample (forward_passes, proposed, accepted)
    step_stats: dict  # this call's metrics record (rl_integration.metrics.step_metrics)
    step: int
    n: int
    keys: list[str] = field(default_factory=list)  # per sample: its prompt's identity
    rewards: Optional[list[float]] = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_prompts(self) -> int:
        return len(self) // self.n if self.n else 0


class RolloutClient:
    """config: a RolloutSection or a whole RunConfig (then seed and history dir default from it).
    model: a transformers causal LM or a local checkpoint folder.
    plain: force speculation and history off (the reference run of --compare).
    backend: a rollout.backend.RolloutBackend to use instead of building one."""

    def __init__(self, config, model=None, *, seed: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, history_dir: Optional[str] = None,
                 progress: bool = False, plain: bool = False, backend=None):
        from rollout import SamplingParams

        if isinstance(config, RunConfig):
            run = config
            config = run.rollout
            if seed is None:
                seed = run.trainer.seed if config.seed is None else config.seed
            if history_dir is None:
                history_dir = config.history.dir or f"{run.output.dir}/history"
        if not isinstance(config, RolloutSection):
            raise ValueError(f"RolloutClient needs a RolloutSection or RunConfig, got {type(config).__name__}")
        self.cfg = config
        self.seed = 0 if seed is None else int(seed)
        if stop_token_ids is None:
            eos = getattr(getattr(model, "config", None), "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                     max_tokens=config.max_tokens, stop_token_ids=tuple(stop_token_ids))
        self.params.validate()
        self.engine_config = plain_engine(config) if plain else config.engine
        self.engine_config.validate()
        spec = self.engine_config.spec
        use_history = (not plain and config.history.enabled and spec is not None
                       and "history" in spec.proposers)
        if use_history and not (history_dir or config.history.dir):
            raise ValueError("rollout.history is enabled: give history_dir= or set rollout.history.dir")
        self.history = (HistoryStore(history_dir or config.history.dir, max_bytes=config.history.max_bytes,
                                     max_age_steps=config.history.max_age_steps) if use_history else None)
        if backend is None:
            if model is None:
                raise ValueError("RolloutClient needs a model (a transformers model or a checkpoint folder)")
            backend = build_backend(config, model, self.engine_config, progress, plain=plain)
        self.backend = backend
        self.step = 0
        self._calls: dict[int, list[dict]] = {}  # step -> the metrics record of each generate call
        self._update_seconds: dict[int, list[float]] = {}  # step -> seconds of each weight update
        self._pending: dict[int, dict] = {}  # step -> (prompt key, sample index) -> HistoryRecord
        self._next_group = 0

    # ---- rollouts -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], n: Optional[int] = None, *,
                 step: Optional[int] = None, keys: Optional[Sequence[str]] = None) -> RolloutBatch:
        """n samples of each prompt (token id lists). step: which step this rollout belongs to
        (default: the current one; a later one ends the current step first). keys: one identity
        per prompt for the seeds (default: a hash of its token ids)."""
        n, prompts, keys = _checked(self.cfg.n if n is None else n, prompts, keys)
        step = self._advance_to(step)
        rows = [(g, s) for g, first in enumerate(_first_samples(keys, n)) for s in range(first, first + n)]
        prompt_ids = [prompts[g] for g, _ in rows]
        seed_step = step if self.cfg.noise == "per_step" else None
        seeds = [sample_seed(self.seed, keys[g], s, seed_step) for g, s in rows]
        groups = [self._next_group + g for g, _ in rows]
        self._next_group += len(prompts)
        found = self._history_drafts(prompt_ids, [s for _, s in rows], step)
        completions, record = self._run(prompt_ids, seeds, groups, found, step)
        batch = RolloutBatch(
            prompt_ids=prompt_ids, completion_ids=[list(c.token_ids) for c in completions],
            logprobs=[list(c.logprobs) for c in completions], seeds=seeds,
            group_index=[g for g, _ in rows], sample_index=[s for _, s in rows],
            finish_reasons=[c.finish_reason for c in completions], sample_stats=[dict(c.stats) for c in completions],
            step_stats=record, step=step, n=n, keys=[keys[g] for g, _ in rows])
        self._pend_history(batch)
        return batch

    def _advance_to(self, step: Optional[int]) -> int:
        """End steps until `step` is the current one (None: stay); returns it."""
        if step is not None:
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"step must be an integer, got {step!r}")
            if step < self.step:
                raise ValueError(f"step {step} is before the client's current step {self.step}")
            while self.step < step:
                self.end_step()
        return self.step

    def _history_drafts(self, prompt_ids, sample_indices, step: int) -> list:
        """Each sample's newest history record from an earlier step (None where there is none)."""
        if self.history is None:
            return []
        return self.history.records_for(prompt_ids, sample_indices, before_step=step)

    def _run(self, prompt_ids, seeds, groups, found, step: int):
        """The backend's completions and this call's metrics record. The old logprobs travel with
        the drafts: they say how sure the old policy was of each token, which the engine's budget
        reads (and the lenient mode compares with)."""
        drafts = [None if h is None else h.token_ids for h in found] if found else None
        draft_lps = [None if h is None else h.logprobs for h in found] if found else None
        start = time.perf_counter()
        completions = self.backend.generate(prompt_ids, self.params, seeds, drafts=drafts, groups=groups,
                                            draft_logprobs=draft_lps)
        seconds = time.perf_counter() - start
        if len(completions) != len(prompt_ids):
            raise RuntimeError(f"the rollout backend returned {len(completions)} completions for "
                               f"{len(prompt_ids)} requests")
        record = M.step_metrics(completions, seconds, self.backend.metrics())
        record["step"] = step
        record["history_found"] = sum(h is not None for h in found)
        self._calls.setdefault(step, []).append(record)
        return completions, record

    def _pend_history(self, batch: RolloutBatch) -> None:
        """The batch's responses, to be written to the history store when the step ends."""
        if self.history is None:
            return
        pending = self._pending.setdefault(batch.step, {})
        for i in range(len(batch)):
            pending[(prompt_key(batch.prompt_ids[i]), batch.sample_index[i])] = HistoryRecord(
                prompt_ids=batch.prompt_ids[i], sample_index=batch.sample_index[i],
                token_ids=batch.completion_ids[i], logprobs=batch.logprobs[i], seed=batch.seeds[i])

    def record_rewards(self, batch: RolloutBatch, rewards: Sequence[float]) -> None:
        """Attach one finite reward per sample: to the batch, the call's reward_mean and the
        history records written at the end of the step."""
        rewards = list(rewards)
        if len(rewards) != len(batch):
            raise ValueError(f"record_rewards got {len(rewards)} rewards for {len(batch)} samples")
        for i, r in enumerate(rewards):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise ValueError(f"reward of sample {i} must be a finite number, got {r!r}")
        batch.rewards = [float(r) for r in rewards]
        batch.step_stats["reward_mean"] = M.mean(batch.rewards)
        pending = self._pending.get(batch.step, {})
        for i, r in enumerate(batch.rewards):
            rec = pending.get((prompt_key(batch.prompt_ids[i]), batch.sample_index[i]))
            if rec is not None and rec.token_ids is batch.completion_ids[i]:
                rec.reward = r

    # ---- steps and metrics --------------------------------------------------------------------

    def step_metrics(self, step: Optional[int] = None) -> dict:
        """The aggregate of a step's generate calls (default: the current step)."""
        step = self.step if step is None else step
        out = M.aggregate(self._calls.get(step, []))
        out["step"] = step
        updates = self._update_seconds.get(step, [])
        out["weight_update_seconds"] = sum(updates) / len(updates) if updates else None  # per update, mean
        return out

    def end_step(self) -> dict:
        """Write this step's responses to the history store; return its metrics; next step."""
        out = self.step_metrics()
        pending = self._pending.pop(self.step, None)
        if self.history is not None and pending:
            self.history.write_step(self.step, list(pending.values()))
        self.step += 1
        return out

    # ---- resuming -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a resumed run's client needs (plain JSON), taken between steps: the step counter
        (it seeds the noise), the next group id, and what the in-process engine's draft budget
        learnt (speed only; Ray workers' budgets start afresh). The history store's files are
        the checkpoint's business (rl_integration/resume.py)."""
        if self._pending:
            raise ValueError(f"RolloutClient.state_dict: step {self.step} has responses not yet written to the "
                             "history (call end_step first)")
        budget = _budget(self.backend)
        return {"step": self.step, "next_group": self._next_group,
                "controller": None if budget is None else budget.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self._next_group = int(state["step"]), int(state["next_group"])
        self._calls.clear()
        self._pending.clear()
        budget = _budget(self.backend)
        if budget is not None and state.get("controller") is not None:
            budget.load_state_dict(state["controller"])

    # ---- weights and lifetime -----------------------------------------------------------------

    def update_weights(self, model) -> None:
        """Push the trainer's weights (a module or a state dict, Hugging Face names)."""
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        start = time.perf_counter()
        self.backend.update_weights({k: v.detach() for k, v in sd.items()})
        self._update_seconds.setdefault(self.step, []).append(time.perf_counter() - start)

    def shutdown(self) -> None:
        self.backend.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _checked(n, prompts, keys):
    """(n, prompts as lists, one key per prompt), or ValueError naming what is wrong."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if keys is None:
        keys = [prompt_key(p) for p in prompts]
    elif len(keys) != len(prompts):
        raise ValueError(f"keys has {len(keys)} entries for {len(prompts)} prompts")
    return n, prompts, keys


def _budget(backend):
    """The in-process engine's draft budget (None for Ray, vLLM or no speculation)."""
    return getattr(getattr(backend, "engine", None), "budget", None)


def _first_samples(keys: Sequence[str], n: int) -> list[int]:
    """Each group's first sample index: 0, or k x n for the k-th repeat of a prompt in one call,
    so that two groups of the same prompt draw different noise (and keep separate history)."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        out.append(seen.get(key, 0) * n)
        seen[key] = seen.get(key, 0) + 1
    return out


def build_backend(cfg: RolloutSection, model, eng_cfg, progress: bool = False, plain: bool = False):
    """The RolloutBackend that rollout.backend and rollout.name name, running `model` (a checkpoint
    folder, a transformers model or a (Hugging Face config, state dict) pair; a Ray backend puts
    in-memory weights in the object store once) with engine config `eng_cfg`. plain: vLLM without
    its own speculation (the reference run of --compare)."""
    vllm = None
    if cfg.name == "vllm":
        import dataclasses

        vllm = dataclasses.replace(cfg.vllm, speculation=None) if plain else cfg.vllm
    if cfg.backend == "local":
        if vllm is not None:
            from rollout.vllm_backend import VllmBackend, import_vllm
            try:
                import_vllm()
            except ImportError as e:
                raise ValueError(f"rollout.name is 'vllm' with rollout.backend 'local': {e} (or rollout.backend=ray: "
                                 "its workers run .venv-vllm's python)") from None
            return VllmBackend(model, eng_cfg, vllm)
        from rollout.backend import LocalBackend
        return LocalBackend(model, eng_cfg, progress=progress)
    try:
        from scheduler.ray_backend import RayRolloutBackend
    except ImportError as e:
        raise ValueError(f"rollout.backend is 'ray' but the Ray backend cannot be imported ({e}); "
                         "install spectail[ray]") from None
    extra = {} if cfg.chunk_tokens is None else {"chunk_tokens": cfg.chunk_tokens}
    if cfg.kept_slots is not None:
        extra["kept_slots"] = cfg.kept_slots
    if vllm is not None:  # vLLM actors (worker class, its options, the Python that has vLLM)
        from scheduler.vllm_worker import ray_options
        extra.update(ray_options(vllm))
    return RayRolloutBackend(model, eng_cfg, num_workers=cfg.num_workers,
                             num_cpus_per_worker=cfg.num_cpus_per_worker,
                             num_gpus_per_worker=cfg.num_gpus_per_worker, address=cfg.ray_address, **extra)
