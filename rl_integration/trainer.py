"""The epoch loop shared by GRPO and PPO: prompts -> rollout -> rewards -> optimizer steps ->
weights to the engine -> metrics, table row, plot.

    records = train(cfg)          # cfg: RunConfig; returns one metrics record per epoch

Everything that can be checked is checked before the first rollout: the config, the data set
and its columns, the reward function's import, the policy, every prompt's length. An epoch's
metrics record is written only once the epoch is complete (metrics.jsonl, metrics.png and
config.yaml under output.dir, each replaced atomically), so a run that fails leaves the files
of its last complete epoch — or, failing in the first epoch, the output folder as it was.

Epochs. Each epoch rolls out `trainer.prompts_per_epoch` prompts: the e-th window of the data
set in a fixed, seeded order, wrapping around. With a data set of exactly prompts_per_epoch
problems (the demo) every epoch revisits every prompt, the setting history reuse is made for;
with a larger one a prompt comes back every len(data) / prompts_per_epoch epochs, and
rollout.history.keep_epochs must reach that far back for its old responses to be used.
"""
from __future__ import annotations

import importlib
import math
import os
import random
import sys
from typing import Callable, Optional

import torch
import yaml

from rollout import threads

from . import metrics as M
from .config import RunConfig, validate
from .config_loader import to_dict
from .dataset import Problem, load_parquet_dataset
from .rollout_client import RolloutClient


class RewardError(RuntimeError):
    """The reward function raised or returned something that is not a finite number."""


# ------------------------------------------------------------------------------ set-up pieces


def load_problems(cfg: RunConfig) -> list[Problem]:
    t = cfg.task
    if t.source == "embedded":
        from .demo.task import make_problems

        problems = make_problems(t.embedded)
    else:
        if not os.path.isfile(t.parquet.path):
            raise ValueError(f"task.parquet.path {t.parquet.path!r} is not a file")
        problems = load_parquet_dataset(t.parquet.path, t.parquet.prompt_key, t.parquet.answer_key)
    if not problems:
        raise ValueError(f"the data set ({t.source}) has no problems")
    if cfg.trainer.prompts_per_epoch > len(problems):
        raise ValueError(f"trainer.prompts_per_epoch is {cfg.trainer.prompts_per_epoch} but the data set has only "
                         f"{len(problems)} problems")
    return problems


def resolve_reward(spec: str) -> Callable[[str, str], float]:
    """'embedded' or 'package.module:function' -> fn(response_text, answer) -> float."""
    if spec == "embedded":
        from .demo.task import reward_fn
        return lambda text, answer: reward_fn(text, answer)
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.reward {spec!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"task.reward {spec!r} is not callable")
    return fn


def load_policy(cfg: RunConfig, progress: bool):
    """(model, tokenizer, folder) of the configured policy, float32, in eval mode."""
    from .demo.policy import load_checkpoint, load_or_train_policy

    p = cfg.policy
    if p.source == "embedded":
        return load_or_train_policy(cfg.task.embedded, p.embedded, cache_dir=p.cache_dir, progress=progress)
    if not os.path.isdir(p.checkpoint):
        raise ValueError(f"policy.checkpoint {p.checkpoint!r} is not a folder")
    model, tokenizer = load_checkpoint(p.checkpoint)
    return model, tokenizer, p.checkpoint


def compute_rewards(fn, spec: str, tokenizer, batch, answers: list[str]) -> list[float]:
    """One reward per sample; a reward function that raises or returns a non-number stops the
    run with an error naming the function, the sample and its prompt."""
    out = []
    for i, ids in enumerate(batch.completion_ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        answer = answers[batch.group_index[i]]
        where = (f"sample {i} of epoch {batch.epoch} (prompt "
                 f"{tokenizer.decode(batch.prompt_ids[i], skip_special_tokens=True)!r}, answer {answer!r})")
        try:
            r = fn(text, answer)
        except Exception as e:
            raise RewardError(f"reward function {spec!r} raised {type(e).__name__}: {e} on {where}") from e
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise RewardError(f"reward function {spec!r} returned {r!r} (need a finite number) on {where}")
        out.append(float(r))
    return out


def clear_history(folder: str) -> None:
    """Remove a previous run's history files (this run's epoch numbers restart at 0, and the
    store keeps the newest epochs, which would be the old run's)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name.startswith("epoch-") and name.endswith(".parquet"):
            os.unlink(os.path.join(folder, name))


def compare_tokens(spec_batch, plain_batch) -> list[int]:
    """Indices of samples whose tokens differ between the speculative and the plain rollout."""
    return [i for i, (a, b) in enumerate(zip(spec_batch.completion_ids, plain_batch.completion_ids)) if a != b]


def make_trainer(cfg: RunConfig, model, pad_id: int):
    from .grpo import GRPOTrainer
    from .ppo import PPOTrainer

    cls = GRPOTrainer if cfg.trainer.algorithm == "grpo" else PPOTrainer
    r = cfg.rollout
    return cls(model, cfg.trainer, r.temperature, r.top_k, r.top_p, pad_id)


# ------------------------------------------------------------------------------ the loop


def train(cfg: RunConfig, progress: Optional[bool] = None, echo: Callable[[str], None] = print,
          on_epoch_end: Optional[Callable[[int, torch.nn.Module], Optional[dict]]] = None) -> list[dict]:
    """Run `cfg.trainer.epochs` epochs; returns the per-epoch metrics records.
    on_epoch_end(epoch, model): called after the epoch's optimizer steps (an evaluation, a
    checkpoint); the dict it returns, if any, joins the epoch's metrics record."""
    validate(cfg)
    progress = cfg.output.progress if progress is None else progress
    tr, out_dir = cfg.trainer, cfg.output.dir
    train_threads = threads.trainer_threads(tr.num_threads)
    threads.announce(f"optimizer steps use {train_threads} torch thread(s)")
    problems = load_problems(cfg)
    reward = resolve_reward(cfg.task.reward)
    model, tokenizer, folder = load_policy(cfg, progress)
    model = model.to(tr.device)
    torch.manual_seed(tr.seed)
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) < cfg.rollout.engine.max_model_len:
            raise ValueError(f"problem {i}'s prompt has {len(ids)} tokens; rollout.engine.max_model_len is "
                             f"{cfg.rollout.engine.max_model_len}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    history_dir = cfg.rollout.history.dir or os.path.join(out_dir, "history")
    source = model if cfg.rollout.backend == "local" else folder

    client = RolloutClient(cfg, source, stop_token_ids=eos, history_dir=history_dir, progress=progress)
    plain = (RolloutClient(cfg, source, stop_token_ids=eos, progress=progress, plain=True)
             if cfg.output.compare else None)
    trainer = make_trainer(cfg, model, pad_id)
    order = list(range(len(problems)))
    random.Random(tr.seed).shuffle(order)
    log = M.MetricsLog(out_dir)
    compare = cfg.output.compare
    if cfg.rollout.noise == "per_sample" and tr.epochs > 1:
        echo("WARNING: rollout.noise=per_sample: every epoch reuses each sample's noise, and the weights are "
             "trained on those draws, so later epochs' samples lean towards what was rewarded before (the "
             "README's noise study measured lower reward); per_epoch is the unbiased default")
    lenience = cfg.rollout.engine.spec.lenience if cfg.rollout.engine.spec else None
    if lenience is not None:
        echo(f"WARNING: rollout.engine.spec.lenience={lenience}: history tokens are accepted leniently, so samples "
             "are BIASED (not exact samples of the policy); see lenient_tokens in metrics.jsonl")
    echo(M.table_header(compare))
    try:
        for epoch in range(tr.epochs):
            start = epoch * tr.prompts_per_epoch
            idx = [order[(start + j) % len(order)] for j in range(tr.prompts_per_epoch)]
            _label(client, f"epoch {epoch} rollout")
            batch = client.generate([prompts[i] for i in idx], epoch=epoch)
            rewards = compute_rewards(reward, cfg.task.reward, tokenizer, batch, [problems[i].answer for i in idx])
            client.record_rewards(batch, rewards)
            extra = {}
            if plain is not None:
                _label(plain, f"epoch {epoch} plain")
                ref = plain.generate([prompts[i] for i in idx], epoch=epoch)
                extra = _compare_record(batch, ref, echo, exact=cfg.rollout.name == "spectail")
            with threads.using(train_threads):
                stats = trainer.step(batch, rewards)
            client.update_weights(model)
            if plain is not None:
                plain.update_weights(model)
                plain.end_epoch()
            if epoch == 0 and client.history is not None and cfg.rollout.history.dir is None:
                clear_history(history_dir)
            record = client.end_epoch()
            record.update(stats)
            record.update(extra)
            record["response_length_mean"] = M.mean(len(c) for c in batch.completion_ids)
            record["truncated_fraction"] = M.mean(f == "length" for f in batch.finish_reasons)
            record["num_samples"] = len(batch)
            if on_epoch_end is not None:
                record.update(on_epoch_end(epoch, model) or {})
            log.append(record)
            if epoch == 0:
                M.atomic_write_text(os.path.join(out_dir, "config.yaml"), yaml.safe_dump(to_dict(cfg), sort_keys=False))
            if cfg.output.plot:
                from .plots import plot_metrics
                plot_metrics(log.records, os.path.join(out_dir, "metrics.png"))
            echo(M.table_row(record, compare))
    finally:
        client.shutdown()
        if plain is not None:
            plain.shutdown()
    return log.records


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
        msg = (f"!!! spec-vs-plain MISMATCH in epoch {batch.epoch}: {len(bad)} of {len(batch)} samples differ "
               f"(first: sample {i}, seed {batch.seeds[i]}); speculation must never change tokens")
        print(msg, file=sys.stderr, flush=True)
    return {"plain_rollout_seconds": plain_s, "plain_tokens_per_second": ref.step_stats["tokens_per_second"],
            "speedup": plain_s / spec_s if spec_s > 0 else None, "tokens_identical": not bad,
            "mismatched_samples": len(bad), "mismatch_expected": lenient}
