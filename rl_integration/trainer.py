"""The step loop shared by GRPO and PPO: prompts -> rollout -> rewards -> optimizer updates ->
weights to the engine -> metrics, table row, plot.

    records = train(cfg)          # cfg: RunConfig; returns one metrics record per step

Everything that can be checked is checked before the first rollout: the config, the data set
(its columns and every row), the reward function's import and one probe call of it
(rl_integration/rewards.py), the policy, every prompt's length (chat prompts through the chat
template). A step's
metrics record is written only once the step is complete (metrics.jsonl, metrics.png and
config.yaml under output.dir, each replaced atomically), so a run that fails leaves the files
of its last complete step — or, failing in the first step, the output folder as it was.

Steps and epochs (the words TRL and verl use). A step is one rollout plus its optimizer
updates: step s rolls out `trainer.prompts_per_step` prompts, the s-th window of the data set
in a fixed, seeded order, wrapping around. An epoch is one pass over the data set; each record
says the epoch its step's first prompt belongs to. With a data set of exactly prompts_per_step
problems (the demo) every step revisits every prompt; with a larger one a prompt comes back
once per epoch, every len(data) / prompts_per_step steps.
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

from rollout import threads

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
    run_config = to_dict(cfg)  # as given: config.yaml and each checkpoint's run.yaml
    progress = cfg.output.progress if progress is None else progress
    tr, out_dir = cfg.trainer, cfg.output.dir
    train_threads = threads.trainer_threads(tr.num_threads)
    threads.announce(f"optimizer steps use {train_threads} torch thread(s)")
    problems = load_problems(cfg)
    reward = resolve_reward(cfg.task)
    check_reward(reward, problems[0])
    fingerprint = resume.data_fingerprint(problems)
    ckpt = resume.find(cfg, tr.resume)
    resume.remove_output_temporaries(out_dir)
    if ckpt is not None:
        resume.check(ckpt, cfg, fingerprint)
        model, tokenizer, reference = resume.load_models(ckpt, cfg, lambda: load_policy(cfg, progress))
        folder = None
    else:
        model, tokenizer, folder = load_policy(cfg, progress)
        reference = None
    model = model.to(tr.device)
    reference = reference.to(tr.device) if reference is not None else None
    saved_state = {"data_sha256": fingerprint, "reference_sha256": ckpt.state.get("reference_sha256") if ckpt else (
        resume.weights_sha256(model) if tr.kl_coef > 0 else None)}
    torch.manual_seed(tr.seed)
    prompts = encode_prompts(tokenizer, problems, cfg.policy.chat_template)
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) < cfg.rollout.engine.max_model_len:
            raise ValueError(f"problem {i}'s prompt has {len(ids)} tokens; rollout.engine.max_model_len is "
                             f"{cfg.rollout.engine.max_model_len}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    history_dir = cfg.rollout.history.dir or os.path.join(out_dir, "history")
    if ckpt is not None:
        resume.restore_history(ckpt, history_dir)
    # Ray workers load a folder; a resumed run's weights go in memory (a checkpoint may be pruned)
    source = model if cfg.rollout.backend == "local" or folder is None else folder
    saved_head = resume.saved_drafter(ckpt, cfg, model)  # before start(): it replaces rollout.drafter.path
    # the drafter's first head, in cfg.rollout.engine (a checkpoint's warm start samples these prompts)
    drafter = online_drafter.start(cfg, folder, progress, prompts, eos)

    client = RolloutClient(cfg, source, stop_token_ids=eos, history_dir=history_dir, progress=progress)
    online_drafter.restore(drafter, client, saved_head)  # the saved head and version, on every engine
    plain = (RolloutClient(same_threads(cfg, client), source, stop_token_ids=eos, progress=progress, plain=True)
             if cfg.output.compare else None)
    trainer = make_trainer(cfg, model, pad_id, reference)
    order = list(range(len(problems)))
    random.Random(tr.seed).shuffle(order)
    log = M.MetricsLog(out_dir)
    compare = cfg.output.compare
    first = 0
    if ckpt is not None:
        first = resume.restore(ckpt, trainer, client, log, cfg)
        if plain is not None:
            plain.load_state_dict({"step": first, "next_group": 0})
        echo(f"resuming from {ckpt.folder}: {first} step(s) done, {max(tr.steps - first, 0)} to go")
    _warn(cfg, echo)
    echo(M.table_header(compare, drafter is not None))
    resume.restore_rng_last(ckpt)
    try:
        for step in range(first, tr.steps):
            start = step * tr.prompts_per_step
            idx = [order[(start + j) % len(order)] for j in range(tr.prompts_per_step)]
            _label(client, f"step {step} rollout")
            batch = client.generate([prompts[i] for i in idx], step=step)
            rewards = compute_rewards(reward, tokenizer, batch, [problems[i] for i in idx])
            client.record_rewards(batch, rewards)
            drafter_stats = online_drafter.after_rollout(drafter, client, batch, rewards)
            extra = {}
            if plain is not None:
                _label(plain, f"step {step} plain")
                ref = plain.generate([prompts[i] for i in idx], step=step)
                extra = _compare_record(batch, ref, echo, exact=cfg.rollout.name == "spectail")
            with threads.using(train_threads):
                stats = trainer.step(batch, rewards)
            client.update_weights(model)
            drafter_stats.update(online_drafter.between_steps(drafter, client))  # trains on the new weights
            if plain is not None:
                plain.update_weights(model)
                plain.end_step()
            if step == 0 and client.history is not None and cfg.rollout.history.dir is None:
                client.history.clear()  # an earlier run's files in this output folder: its step numbers are ours
            record = client.end_step()
            record["epoch"] = start // len(order)
            record.update(stats)
            record.update(extra)
            record.update(drafter_stats)
            record["response_length_mean"] = M.mean(len(c) for c in batch.completion_ids)
            record["truncated_fraction"] = M.mean(f == "length" for f in batch.finish_reasons)
            record["num_samples"] = len(batch)
            record["rollout_sha256"] = M.rollout_digest(batch.completion_ids, rewards)
            record["memory_rss_mb"] = M.resident_mb()
            if on_step_end is not None:
                record.update(on_step_end(step, model) or {})
            log.append(record)
            if step == first:
                M.atomic_write_text(os.path.join(out_dir, "config.yaml"), yaml.safe_dump(run_config, sort_keys=False))
            if resume.due(tr, step):
                resume.save(cfg, run_config, step + 1, model, tokenizer, trainer, client, log.records, saved_state,
                            drafter=drafter)
            if cfg.output.plot:
                from .plots import plot_metrics
                plot_metrics(log.records, os.path.join(out_dir, "metrics.png"))
            echo(M.table_row(record, compare, drafter is not None))
    finally:
        client.shutdown()
        if plain is not None:
            plain.shutdown()
    return log.records


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
