"""The step loop shared by GRPO and PPO: prompts -> rollout -> rewards -> optimizer updates ->
weights to the engine -> metrics, table row, plot.

    records = train(cfg)          # cfg: RunConfig; returns one metrics record per step

Everything that can be checked is checked before the first rollout (the config, the data set,
the reward function by one probe call, the policy, every prompt's length). A step's metrics
record is written only once the step is complete (metrics.jsonl, metrics.png and config.yaml
under output.dir, each replaced atomically), so a failed run leaves the files of its last
complete step. Step s rolls out `trainer.prompts_per_step` prompts, the s-th window of the data
set in a fixed, seeded order, wrapping around; an epoch is one pass over the data set.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import random
import sys
from typing import Callable, Optional

import torch
import yaml

from rollout.core import threads
from scheduler.history_store import restore_files

from . import metrics as M
from . import online_drafter, real_model, resume
from .config import RunConfig, validate
from .config_loader import to_dict
from .dataset import Problem, encode_prompts, load_parquet_dataset
from .rewards import RewardError, check_reward, compute_rewards, resolve_reward
from .rollout_client import RolloutClient

__all__ = ["RewardError", "compute_rewards", "load_policy", "load_problems", "resolve_reward", "train"]


# ------------------------------------------------------------------------------ set-up pieces


def load_problems(cfg: RunConfig) -> list[Problem]:
    t = cfg.task
    if t.source == "embedded":
        from .demo.task import make_problems

        problems = make_problems(t.embedded)
    elif t.source == "reasoning_gym":
        from .reasoning_gym_task import make_problems as reasoning_gym_problems

        problems = reasoning_gym_problems(t.reasoning_gym)
    else:
        if not os.path.isfile(t.parquet.path):
            raise ValueError(f"task.parquet.path {t.parquet.path!r} is not a file")
        q = t.parquet
        problems = load_parquet_dataset(q.path, q.prompt_key, q.answer_key, q.data_source_key, q.extra_info_key)
    if not problems:
        raise ValueError(f"the data set ({t.source}) has no problems")
    if cfg.trainer.prompts_per_step > len(problems):
        raise ValueError(f"trainer.prompts_per_step is {cfg.trainer.prompts_per_step} but the data set has only "
                         f"{len(problems)} problems")
    return problems


def load_policy(cfg: RunConfig, progress: bool):
    """(model, tokenizer, folder) of the configured policy, float32, in eval mode."""
    from .demo.policy import load_folder_or_hub, load_or_train_policy

    p = cfg.policy
    if p.source == "embedded":
        return load_or_train_policy(cfg.task.embedded, p.embedded, cache_dir=p.cache_dir, progress=progress)
    if p.checkpoint in real_model.KNOWN and not os.path.isdir(p.checkpoint):  # "smollm2": fetched on first use
        return load_folder_or_hub(real_model.fetch(p.checkpoint, "float32", echo=print))
    return load_folder_or_hub(p.checkpoint)


def compare_tokens(spec_batch, plain_batch) -> list[int]:
    """Indices of samples whose tokens differ between the speculative and the plain rollout."""
    return [i for i, (a, b) in enumerate(zip(spec_batch.completion_ids, plain_batch.completion_ids)) if a != b]


def same_threads(cfg: RunConfig, client: RolloutClient) -> RunConfig:
    """cfg with the thread count the client's in-process engine chose (an engine that picks its own
    times one and two threads at its start, which the machine's noise can swing): --compare's
    plain engine then runs on as many threads as the engine it is set against."""
    chosen = getattr(getattr(client.backend, "engine", None), "num_threads", None)
    if chosen is None or cfg.rollout.engine.num_threads is not None:
        return cfg
    same = copy.copy(cfg)
    same.rollout = dataclasses.replace(cfg.rollout, engine=dataclasses.replace(cfg.rollout.engine, num_threads=chosen))
    return same


def make_trainer(cfg: RunConfig, model, pad_id: int, ref_model=None):
    from .grpo import GRPOTrainer
    from .ppo import PPOTrainer

    cls = GRPOTrainer if cfg.trainer.algorithm == "grpo" else PPOTrainer
    r = cfg.rollout
    return cls(model, cfg.trainer, r.temperature, r.top_k, r.top_p, pad_id, ref_model=ref_model)


# ------------------------------------------------------------------------------ the loop


def train(cfg: RunConfig, progress: Optional[bool] = None, echo: Callable[[str], None] = print,
          on_step_end: Optional[Callable[[int, torch.nn.Module], Optional[dict]]] = None) -> list[dict]:
    """Run `cfg.trainer.steps` steps (from a checkpoint when trainer.resume says so); returns the
    per-step metrics records. on_step_end(step, model): called after the step's optimizer
    updates (an evaluation, ...); the dict it returns, if any, joins the step's metrics record."""
    validate(cfg)
    run = Run(cfg, cfg.output.progress if progress is None else progress, echo)
    try:
        run.start()
        for step in range(run.first, cfg.trainer.steps):
            run.step(step, on_step_end)
    finally:
        run.shutdown()
    return run.log.records


class Run:
    """One training run: set up by start(), then step() per step."""

    def __init__(self, cfg: RunConfig, progress: bool, echo: Callable[[str], None]):
        self.cfg, self.progress, self.echo = cfg, progress, echo
        self.run_config = to_dict(cfg)  # as given: config.yaml and each checkpoint's run.yaml
        self.client = self.plain = None

    def start(self) -> None:
        cfg, tr = self.cfg, self.cfg.trainer
        self.train_threads = threads.trainer_threads(tr.num_threads)
        threads.announce(f"optimizer steps use {self.train_threads} torch thread(s)")
        self.problems = load_problems(cfg)
        self.reward = resolve_reward(cfg.task)
        check_reward(self.reward, self.problems[0])
        fingerprint = resume.data_fingerprint(self.problems)
        ckpt = resume.find(cfg, tr.resume)
        resume.remove_output_temporaries(cfg.output.dir)
        folder, reference = self._load_models(ckpt, fingerprint)
        torch.manual_seed(tr.seed)
        self.prompts = self._encode_prompts()
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        self._start_clients(ckpt, folder, eos)
        self.trainer = make_trainer(cfg, self.model, pad_id, reference)
        self.order = list(range(len(self.problems)))
        random.Random(tr.seed).shuffle(self.order)
        self.log = M.MetricsLog(cfg.output.dir)
        self.first = 0 if ckpt is None else self._resume(ckpt)
        _warn(cfg, self.echo)
        self.echo(M.table_header(cfg.output.compare, self.drafter is not None))
        resume.restore_rng_last(ckpt)

    def _load_models(self, ckpt, fingerprint: str):
        """The policy (and KL reference) on the trainer's device; returns (policy folder or None,
        reference or None). A resumed run's policy comes from its checkpoint."""
        cfg, tr = self.cfg, self.cfg.trainer
        if ckpt is not None:
            resume.check(ckpt, cfg, fingerprint)
            model, self.tokenizer, reference = resume.load_models(ckpt, cfg, lambda: load_policy(cfg, self.progress))
            folder = None
        else:
            model, self.tokenizer, folder = load_policy(cfg, self.progress)
            reference = None
        self.model = model.to(tr.device)
        reference = reference.to(tr.device) if reference is not None else None
        self.saved_state = {"data_sha256": fingerprint, "reference_sha256": ckpt.state.get("reference_sha256") if ckpt
                            else (resume.weights_sha256(self.model) if tr.kl_coef > 0 else None)}
        return folder, reference

    def _encode_prompts(self) -> list[list[int]]:
        prompts = encode_prompts(self.tokenizer, self.problems, self.cfg.policy.chat_template)
        limit = self.cfg.rollout.engine.max_model_len
        for i, ids in enumerate(prompts):
            if not 0 < len(ids) < limit:
                raise ValueError(f"problem {i}'s prompt has {len(ids)} tokens; rollout.engine.max_model_len is {limit}")
        return prompts

    def _start_clients(self, ckpt, folder: Optional[str], eos: list[int]) -> None:
        """The drafter, the rollout client (and --compare's plain one), the history as saved."""
        cfg, progress = self.cfg, self.progress
        history_dir = cfg.rollout.history.dir or os.path.join(cfg.output.dir, "history")
        if ckpt is not None:  # the store as it was at the checkpoint (a killed run's later files go)
            restore_files(history_dir, ckpt.history)
        # Ray workers load a folder; a resumed run's weights go in memory (a checkpoint may be pruned)
        source = self.model if cfg.rollout.backend == "local" or folder is None else folder
        saved_head = resume.saved_drafter(ckpt, cfg, self.model)  # before start(): it replaces rollout.drafter.path
        # the drafter's first head, in cfg.rollout.engine (a checkpoint's warm start samples these prompts)
        self.drafter = online_drafter.start(cfg, folder, progress, self.prompts, eos)
        self.client = RolloutClient(cfg, source, stop_token_ids=eos, history_dir=history_dir, progress=progress)
        online_drafter.restore(self.drafter, self.client, saved_head)  # the saved head and version, on every engine
        if cfg.output.compare:
            self.plain = RolloutClient(same_threads(cfg, self.client), source, stop_token_ids=eos, progress=progress,
                                       plain=True)

    def _resume(self, ckpt) -> int:
        first = resume.restore(ckpt, self.trainer, self.client, self.log, self.cfg)
        if self.plain is not None:
            self.plain.load_state_dict({"step": first, "next_group": 0})
        self.echo(f"resuming from {ckpt.folder}: {first} step(s) done, {max(self.cfg.trainer.steps - first, 0)} to go")
        return first

    def step(self, step: int, on_step_end=None) -> None:
        """Rollout, rewards, optimizer updates, new weights to the engines; then the step's record."""
        cfg = self.cfg
        idx = self._prompt_indices(step)
        batch, rewards, drafter_stats = self._rollout(step, idx)
        extra = self._compare(step, idx, batch) if self.plain is not None else {}
        with threads.using(self.train_threads):
            stats = self.trainer.step(batch, rewards)
        self.client.update_weights(self.model)
        drafter_stats.update(online_drafter.between_steps(self.drafter, self.client))  # trains on the new weights
        if self.plain is not None:
            self.plain.update_weights(self.model)
            self.plain.end_step()
        if step == 0 and self.client.history is not None and cfg.rollout.history.dir is None:
            self.client.history.clear()  # an earlier run's files in this output folder: its step numbers are ours
        record = self._record(step, batch, rewards, {**stats, **extra, **drafter_stats})
        if on_step_end is not None:
            record.update(on_step_end(step, self.model) or {})
        self._write(step, record)

    def _prompt_indices(self, step: int) -> list[int]:
        start = step * self.cfg.trainer.prompts_per_step
        return [self.order[(start + j) % len(self.order)] for j in range(self.cfg.trainer.prompts_per_step)]

    def _rollout(self, step: int, idx: list[int]):
        _label(self.client, f"step {step} rollout")
        batch = self.client.generate([self.prompts[i] for i in idx], step=step)
        rewards = compute_rewards(self.reward, self.tokenizer, batch, [self.problems[i] for i in idx])
        self.client.record_rewards(batch, rewards)
        return batch, rewards, online_drafter.after_rollout(self.drafter, self.client, batch, rewards)

    def _compare(self, step: int, idx: list[int], batch) -> dict:
        _label(self.plain, f"step {step} plain")
        ref = self.plain.generate([self.prompts[i] for i in idx], step=step)
        return _compare_record(batch, ref, self.echo, exact=self.cfg.rollout.name == "spectail")

    def _record(self, step: int, batch, rewards, stats: dict) -> dict:
        record = self.client.end_step()
        record["epoch"] = step * self.cfg.trainer.prompts_per_step // len(self.order)
        record.update(stats)
        record["response_length_mean"] = M.mean(len(c) for c in batch.completion_ids)
        record["truncated_fraction"] = M.mean(f == "length" for f in batch.finish_reasons)
        record["num_samples"] = len(batch)
        record["rollout_sha256"] = M.rollout_digest(batch.completion_ids, rewards)
        record["memory_rss_mb"] = M.resident_mb()
        return record

    def _write(self, step: int, record: dict) -> None:
        """metrics.jsonl (config.yaml with the first), the checkpoint when due, the plot, the table row."""
        cfg, out_dir = self.cfg, self.cfg.output.dir
        self.log.append(record)
        if step == self.first:
            M.atomic_write_text(os.path.join(out_dir, "config.yaml"), yaml.safe_dump(self.run_config, sort_keys=False))
        if resume.due(cfg.trainer, step):
            resume.save(cfg, self.run_config, step + 1, self.model, self.tokenizer, self.trainer, self.client,
                        self.log.records, self.saved_state, drafter=self.drafter)
        if cfg.output.plot:
            from .plots import plot_metrics
            plot_metrics(self.log.records, os.path.join(out_dir, "metrics.png"))
        self.echo(M.table_row(record, cfg.output.compare, self.drafter is not None))

    def shutdown(self) -> None:
        for client in (self.client, self.plain):
            if client is not None:
                client.shutdown()
def _warn(cfg: RunConfig, echo) -> None:
    if cfg.rollout.noise == "per_sample" and cfg.trainer.steps > 1:
        echo("WARNING: rollout.noise=per_sample: every step reuses each sample's noise, and the weights are "
             "trained on those draws, so later steps' samples lean towards what was rewarded before (the "
             "README's noise study measured lower reward); per_step is the unbiased default")
    lenience = cfg.rollout.engine.spec.lenience if cfg.rollout.engine.spec else None
    if lenience is not None:
        echo(f"WARNING: rollout.engine.spec.lenience={lenience}: history tokens are accepted leniently, so samples "
             "are BIASED (not exact samples of the policy); see lenient_tokens in metrics.jsonl")


def _label(client: RolloutClient, text: str) -> None:
    if hasattr(client.backend, "desc"):
        client.backend.desc = text


def _compare_record(batch, ref, echo, exact: bool = True) -> dict:
    """exact: the engine promises the same tokens with speculation on and off (spectail's does;
    vLLM's rejection sampling is lossless in distribution only, docs/guarantees.md)."""
    bad = compare_tokens(batch, ref)
    spec_s, plain_s = batch.step_stats["rollout_seconds"], ref.step_stats["rollout_seconds"]
    lenient = batch.step_stats.get("lenient_tokens", 0) > 0 or not exact
    if bad and not lenient:
        i = bad[0]
        msg = (f"!!! spec-vs-plain MISMATCH in step {batch.step}: {len(bad)} of {len(batch)} samples differ "
               f"(first: sample {i}, seed {batch.seeds[i]}); speculation must never change tokens")
        print(msg, file=sys.stderr, flush=True)
    return {"plain_rollout_seconds": plain_s, "plain_tokens_per_second": ref.step_stats["tokens_per_second"],
            "speedup": plain_s / spec_s if spec_s > 0 else None, "tokens_identical": not bad,
            "mismatched_samples": len(bad), "mismatch_expected": lenient}
