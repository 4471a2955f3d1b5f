"""Checkpoints in the step loop, and resuming a run from one (docs/checkpoints.md).

    ckpt = find(cfg, cfg.trainer.resume)        # None: a fresh run; a Checkpoint to continue from
    check(ckpt, cfg, fingerprint)               # ValueError naming a key that would change the run
    start = restore(ckpt, trainer, client, log, cfg)
    if due(cfg.trainer, step): save(...)        # after the step's metrics record is appended

A resumed run brings back what makes step s's tokens what they are (the weights, the optimizer
and its step counter, the seeds) and, to be *bitwise* the uninterrupted run, the history store's
files and what the draft budget learnt (docs/checkpoints.md). Checkpoint `step-N` is written after
step N-1's metrics record, so a run killed later redoes the steps from N with the same tokens.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from scheduler.atomic_file import TMP_SUFFIX, remove_stale

from . import checkpoint as C
from .checkpoint import Checkpoint, checkpoints_dir
from .config import RESUME_MAY_CHANGE, RESUME_MUST_KEEP, RunConfig, upgrade_saved
from .config_loader import from_dict, to_dict

# ------------------------------------------------------------------------------ finding and checking


def find(cfg: RunConfig, resume: Optional[str]) -> Optional[Checkpoint]:
    """The checkpoint to continue from: None for a fresh run (resume None, or "auto" when
    output.dir has no complete checkpoint); resume may name a checkpoint folder, a folder of
    them, or an output folder (then its newest complete one). A fresh run refuses an output.dir
    that holds checkpoints: it would mix two runs' steps."""
    root = checkpoints_dir(cfg.output.dir)
    if resume is None:
        newest = C.latest_complete(root, verify=False)
        if newest is not None:
            raise ValueError(f"output.dir {cfg.output.dir!r} holds checkpoints of an earlier run (newest: "
                             f"{newest.name}); continue it with --resume auto (trainer.resume=auto), or give "
                             f"another output.dir, or delete {root}")
        return None
    if resume == "auto":
        folder = C.latest_complete(root)
        return None if folder is None else C.load_checkpoint(folder)
    return C.load_checkpoint(_checkpoint_in(Path(resume)))


def _checkpoint_in(folder: Path) -> Path:
    if (folder / C.MANIFEST).exists() or not folder.is_dir():
        return folder  # load_checkpoint says what is wrong with it, if anything
    for root in (folder, checkpoints_dir(folder)):
        if C.list_checkpoints(root):
            newest = C.latest_complete(root)
            if newest is None:
                raise ValueError(f"trainer.resume: {root} holds no complete checkpoint")
            return newest
    raise ValueError(f"trainer.resume: {os.fspath(folder)!r} is neither a checkpoint (step-N) folder nor holds any")


def check(ckpt: Checkpoint, cfg: RunConfig, fingerprint: str) -> None:
    """Refuse a config or a data set that would make the resumed run another run."""
    if ckpt.config is None:
        raise ValueError(f"checkpoint {ckpt.folder} has no run.yaml: it was not written by spectail train")
    try:
        saved = from_dict(RunConfig, upgrade_saved(ckpt.config))
    except ValueError as e:
        raise ValueError(f"checkpoint {ckpt.folder}: its run.yaml does not load in this spectail ({e})") from None
    changed = changed_keys(to_dict(saved), to_dict(cfg), _lenient(saved) or _lenient(cfg))
    if changed:
        key, old, new = changed[0]
        raise ValueError(f"config key {key!r} is {old!r} in checkpoint {ckpt.folder} and {new!r} now; a resumed run "
                         "must keep it (it changes the samples or the updates; the keys that may change are listed "
                         "in docs/checkpoints.md)" + (f"; also changed: {[k for k, _, _ in changed[1:]]}"
                                                      if len(changed) > 1 else ""))
    if ckpt.state.get("data_sha256") != fingerprint:
        raise ValueError(f"the data set differs from the one checkpoint {ckpt.folder} was trained on (its prompts, "
                         "answers or order of rows); a resumed run must read the same data")


def changed_keys(old: dict, new: dict, lenient: bool) -> list[tuple[str, object, object]]:
    """(dotted key, old, new) of every leaf that differs and may not (config.RESUME_MAY_CHANGE)."""
    a, b = _flat(old), _flat(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key) and not _may_change(key, lenient):
            out.append((key, a.get(key), b.get(key)))
    return out


def _may_change(key: str, lenient: bool) -> bool:
    def under(prefixes):
        return any(key == p or key.startswith(p + ".") for p in prefixes)
    if under(RESUME_MUST_KEEP):
        return False
    if lenient and under(("rollout.engine.spec", "rollout.history")):
        return False  # lenient acceptance makes every draft setting change the samples
    return under(RESUME_MAY_CHANGE)


def _lenient(cfg: RunConfig) -> bool:
    spec = cfg.rollout.engine.spec
    return spec is not None and spec.lenience is not None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def data_fingerprint(problems) -> str:
    """sha256 of the data set's rows, in order (prompts, answers, sources, extra info)."""
    h = hashlib.sha256()
    for p in problems:
        row = dataclasses.asdict(p)
        row.pop("solution", None)  # the demo's worked solutions never reach the run
        h.update(json.dumps(row, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of a model's state dict (names, dtypes, shapes, bytes): the KL reference's identity."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------ restoring


def load_models(ckpt: Checkpoint, cfg: RunConfig, load_initial: Callable[[], tuple]):
    """(policy, tokenizer, KL reference or None) of a resumed run: the policy from the checkpoint;
    the reference (kl_coef > 0) is the run's initial policy, loaded again and checked by hash."""
    from .demo.policy import load_checkpoint as load_folder

    model, tokenizer = load_folder(os.fspath(ckpt.folder))
    if cfg.trainer.kl_coef <= 0:
        return model, tokenizer, None
    initial = load_initial()[0]
    if weights_sha256(initial) != ckpt.state.get("reference_sha256"):
        raise ValueError(f"trainer.kl_coef > 0: the initial policy ({cfg.policy.source}) is not the one checkpoint "
                         f"{ckpt.folder} started from (its weights' hash differs), so the KL reference would change")
    return model, tokenizer, initial.eval().requires_grad_(False)


def restore(ckpt: Checkpoint, trainer, client, log, cfg: RunConfig) -> int:
    """Trainer, client and metrics as they were after the checkpoint's step; later checkpoints
    (another timeline) go. Returns the step to continue from. Restore the RNG last (restore_rng)."""
    state = ckpt.state
    if state.get("client", {}).get("step") != ckpt.step or len(ckpt.metrics or []) != ckpt.step:
        raise ValueError(f"checkpoint {ckpt.folder}: its state.json or metrics.jsonl does not say {ckpt.step} steps")
    trainer.load_state_dict({"optimizer": ckpt.optimizer, "scheduler": ckpt.scheduler,
                             "steps": state["trainer"]["steps"], "value_head": ckpt.value_head})
    client.load_state_dict(state["client"])
    if ckpt.metrics:  # metrics.jsonl holds exactly the checkpoint's records (a killed run's later ones go)
        log.records = list(ckpt.metrics[:-1])
        log.append(ckpt.metrics[-1])
    C.discard_after(checkpoints_dir(cfg.output.dir), ckpt.step)
    return ckpt.step


def saved_drafter(ckpt: Optional[Checkpoint], cfg: RunConfig, model) -> Optional[tuple[int, dict]]:
    """(version, drafter.export.head_state) of the head the checkpoint saved, checked against the
    policy, for online_drafter.restore. One that does not fit: a warning and None (no head until
    training makes one; never a changed token). Call it before the drafter starts: a usable head
    replaces rollout.drafter.path, so no engine first loads another at version 0."""
    if ckpt is None or not isinstance(ckpt.drafter, Path) or not cfg.rollout.drafter.enabled:
        return None
    from drafter.export import check_state, read_state

    try:
        state, version = read_state(ckpt.drafter)
        check_state(state, model.config.hidden_size, model.config.vocab_size)
    except ValueError as e:
        warnings.warn(f"drafter: the head saved in {ckpt.folder} does not load, the resumed run starts without "
                      f"one: {e}", stacklevel=2)
        return None
    cfg.rollout.drafter = dataclasses.replace(cfg.rollout.drafter, path=None)
    return version, state


# ------------------------------------------------------------------------------ saving


def due(tr, step: int) -> bool:
    """Whether to save after step `step` (0-based): every save_every steps, and after the last."""
    return tr.save_every > 0 and ((step + 1) % tr.save_every == 0 or step == tr.steps - 1)


def save(cfg: RunConfig, run_config: dict, steps_done: int, model, tokenizer, trainer, client, records: list,
         extra_state: dict, drafter=None) -> Path:
    """checkpoints/step-<steps_done>: everything `restore` needs, written atomically; then the
    newest trainer.keep_checkpoints are kept. drafter: the loop's online drafter, if any (the
    drafter_folder hook exports it)."""
    ts = trainer.state_dict()
    state = {"trainer": {"steps": ts["steps"]}, "client": client.state_dict(), **extra_state}
    history = client.history.files() if client.history is not None else []
    with tempfile.TemporaryDirectory(prefix="spectail-drafter-") as scratch:
        return C.save_checkpoint(checkpoints_dir(cfg.output.dir), steps_done, model, tokenizer=tokenizer,
                               optimizer=ts["optimizer"], scheduler=ts["scheduler"], value_head=ts.get("value_head"),
                               drafter=drafter_folder(drafter, client, Path(scratch)), config=run_config, state=state,
                               history=history, metrics=records, keep=cfg.trainer.keep_checkpoints)


def drafter_folder(drafter, client, scratch: Path) -> Optional[Path]:
    """The newest head the run drafts with (the local engine's, or the newest published to the
    Ray workers), exported with its version into `scratch` (drafter/export.py), which the
    checkpoint copies to drafter/ and saved_drafter() reads back. None: no drafter, or no head."""
    from .online_drafter import latest_head

    latest = latest_head(drafter, client)
    if latest is None:
        return None
    from drafter.export import export_state

    version, state = latest
    export_state(state, scratch / "head", version)
    return scratch / "head"


OUTPUT_FILES = ("metrics.jsonl", "metrics.png", "config.yaml")  # what the loop writes into output.dir


def remove_output_temporaries(out_dir: str) -> None:
    """A killed run's temporaries of its output files (`.<name>.<random>.tmp`, atomic_file.py),
    whatever their age: only one run writes an output folder at a time."""
    remove_stale(out_dir, lambda n: n.endswith(TMP_SUFFIX) and any(n.startswith(f".{f}.") for f in OUTPUT_FILES), -1)


def restore_rng_last(ckpt: Optional[Checkpoint]) -> None:
    """The global generators as they were at the save (the set-up before the loop draws from them:
    torch.manual_seed, module inits), so call it right before the first resumed step."""
    if ckpt is not None:
        C.restore_rng(ckpt.rng)
