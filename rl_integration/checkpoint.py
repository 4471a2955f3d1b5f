"""Checkpoints of a training run: one folder per saved step, written atomically, loadable by users.

    path = save_checkpoint("runs/demo/checkpoints", 4, model, tokenizer=tok, optimizer=opt,
                           config=cfg, state={"client": {...}}, history=[...], metrics=records, keep=2)
    path = latest_complete("runs/demo/checkpoints")         # None when there is none
    ckpt = load_checkpoint(path)                             # pieces; ValueError saying what is wrong
    AutoModelForCausalLM.from_pretrained(path)               # the policy: the folder is a Hugging Face one

`step-N/` is the run after N steps; its files, the manifest and the atomic write are described in
docs/checkpoints.md. History files (the store's immutable Parquet files) are recorded by size only:
hashing them would read the whole store at every save. No extra file ends in .safetensors (the
engine loads every one it finds at the top). Re-saving a step moves the old folder aside first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
import yaml

from scheduler.atomic_file import TMP_SUFFIX, fsync_dir, link_or_copy

FORMAT, VERSION = "spectail-checkpoint", 1
MANIFEST = "manifest.json"
HISTORY = "history"  # the folder of linked history files
METRICS = "metrics.jsonl"
STALE_TMP_SECONDS = 6 * 3600.0  # far longer than any checkpoint write: its writer is gone
_DIR_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.step-\d+\.(?P<host>[^.]*)\.(?P<pid>\d+)\..*" + re.escape(TMP_SUFFIX) + "$")


def checkpoints_dir(output_dir) -> Path:
    """Where a run's checkpoints live: output.dir/checkpoints."""
    return Path(output_dir) / "checkpoints"


@dataclass
class Checkpoint:
    """A loaded checkpoint's pieces; the policy itself loads from `folder` (a Hugging Face folder)."""

    folder: Path
    step: int  # steps done: the resumed run starts at this step
    manifest: dict
    optimizer: Optional[dict]
    scheduler: Optional[dict]
    value_head: Optional[dict]
    drafter: Optional[Any]  # the drafter folder's path, or its state dict
    rng: dict
    state: dict
    config: Optional[dict]
    metrics: Optional[list]  # the metrics records saved with it
    history: list  # paths of its linked history files

    def load_model(self, **kwargs):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(self.folder, **kwargs)

    def load_tokenizer(self):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(self.folder)


# ---------------------------------------------------------------------------------- writing


def save_checkpoint(root, step: int, model, *, tokenizer=None, optimizer=None, scheduler=None,
                    value_head=None, drafter=None, config=None, state: Optional[dict] = None,
                    history: Sequence = (), metrics: Optional[Sequence[dict]] = None,
                    keep: Optional[int] = None) -> Path:
    """Write `root/step-N` atomically and return its path; then keep the newest `keep` checkpoints
    (None: all). optimizer, scheduler, value_head, drafter: objects with state_dict() or state
    dicts (drafter also: a folder to copy); config: a RunConfig or a mapping; state: plain JSON;
    history: files to link. Bad arguments raise ValueError before anything is written."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep (checkpoints kept) must be an integer >= 1 or None, got {keep!r}")
    if not hasattr(model, "save_pretrained"):
        raise ValueError(f"the model must be a transformers model (save_pretrained), got {type(model).__name__}")
    state_text = _json_text(state or {}, "state")
    metrics_text = None if metrics is None else _jsonl_text(metrics)
    config_text = None if config is None else _config_text(config)
    history = [Path(h) for h in history]
    for h in history:
        if not h.is_file():
            raise ValueError(f"history file {os.fspath(h)!r} does not exist")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step}.{_host()}.{os.getpid()}.", suffix=TMP_SUFFIX))
    try:
        _write_pieces(tmp, model, tokenizer, optimizer, scheduler, value_head, drafter)
        _write_rng(tmp / "rng.pt")
        (tmp / "state.json").write_text(state_text, encoding="utf-8")
        if config_text is not None:
            (tmp / "run.yaml").write_text(config_text, encoding="utf-8")
        if metrics_text is not None:
            (tmp / METRICS).write_text(metrics_text, encoding="utf-8")
        if history:
            (tmp / HISTORY).mkdir()
        for h in history:
            link_or_copy(h, tmp / HISTORY / h.name)
        _write_manifest(tmp, step)
        _fsync_tree(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it private; a checkpoint is an ordinary folder
        final = _publish(tmp, root / f"step-{step}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        prune(root, keep)
    return final


def _write_pieces(folder: Path, model, tokenizer, optimizer, scheduler, value_head, drafter) -> None:
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    torch.save({"optimizer": None if optimizer is None else _state_dict(optimizer, "optimizer"),
                "scheduler": None if scheduler is None else _state_dict(scheduler, "scheduler")},
               folder / "trainer.pt")
    if value_head is not None:
        torch.save(_state_dict(value_head, "value_head"), folder / "value_head.pt")
    if drafter is not None:
        if isinstance(drafter, (str, os.PathLike)):
            if not Path(drafter).is_dir():
                raise ValueError(f"drafter {os.fspath(drafter)!r} is not a folder")
            shutil.copytree(drafter, folder / "drafter")
        else:
            (folder / "drafter").mkdir()
            torch.save(_state_dict(drafter, "drafter"), folder / "drafter" / "state.pt")


def _state_dict(obj, what: str) -> dict:
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, torch.nn.Module) or hasattr(obj, "state_dict"):
        return obj.state_dict()
    raise ValueError(f"{what} must be a torch module or a state dict, got {type(obj).__name__}")


def _json_text(value, what: str) -> str:
    try:
        return json.dumps(value, indent=1, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {what} must be plain JSON (no NaN): {e}") from None


def _jsonl_text(records: Sequence[dict]) -> str:
    """metrics.jsonl's own format (rl_integration.metrics.MetricsLog): a NaN loss is a record too."""
    try:
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint metrics must be JSON records: {e}") from None


def _config_text(config) -> str:
    if dataclasses.is_dataclass(config):
        from .config_loader import to_dict
        config = to_dict(config)
    try:
        return yaml.safe_dump(config, sort_keys=False)
    except yaml.YAMLError as e:
        raise ValueError(f"checkpoint config must be a RunConfig or a plain mapping: {e}") from None


def restore_rng(rng: dict) -> None:
    """Put the generators back as _write_rng saved them (CUDA's only where there is CUDA)."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _write_rng(path: Path) -> None:
    """The generators a run draws from: Python's, NumPy's global one, torch's (CPU and CUDA)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    torch.save({"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, path)


def _write_manifest(folder: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        linked = name.startswith(HISTORY + "/")  # size only (module docstring)
        files[name] = {"bytes": path.stat().st_size, "sha256": None if linked else _sha256(path)}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def _publish(tmp: Path, final: Path) -> Path:
    old = None
    if final.exists():  # the same step again (say after a resume): move the old one aside first
        old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.{_host()}.{os.getpid()}.old.",
                                    suffix=TMP_SUFFIX))
        os.rename(final, old / final.name)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- reading


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` folder under root, oldest first, complete or not."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), Path(e.path)) for e in entries if (m := _DIR_RE.match(e.name)) and e.is_dir()]
    return sorted(found)


def latest_complete(root, verify: bool = True) -> Optional[Path]:
    """The newest checkpoint whose manifest is there and whose files all have their recorded
    sizes and hashes (verify=False: sizes only, no reading); None when there is none."""
    for _, folder in reversed(list_checkpoints(root)):
        if check_complete(folder, verify) is None:
            return folder
    return None


def check_complete(folder, verify: bool = True) -> Optional[str]:
    """None when the folder is a complete checkpoint, else why it is not."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        return str(e)
    for name, meta in manifest["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"checkpoint {folder} lacks {name}"
        if size != meta.get("bytes"):
            return f"checkpoint {folder}: {name} has {size} bytes, the manifest says {meta.get('bytes')}"
        if verify and meta.get("sha256") is not None and _sha256(path) != meta["sha256"]:
            return f"checkpoint {folder}: {name} does not match its sha256 in the manifest (damaged)"
    return None


def read_manifest(folder) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {os.fspath(folder)!r} does not exist")
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"checkpoint {folder} is incomplete: no {MANIFEST} (its write was interrupted)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e})") from None
    ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT
    if not ours or not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("step"), int):
        raise ValueError(f"checkpoint {folder}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"checkpoint {folder} has format version {manifest.get('version')!r}; this spectail "
                         f"reads version {VERSION}")
    return manifest


def load_checkpoint(folder, verify: bool = True) -> Checkpoint:
    """The pieces of a complete checkpoint (tensors on the CPU); ValueError naming what is wrong
    (missing, incomplete, damaged, unreadable). The policy: Checkpoint.load_model()."""
    folder = Path(folder)
    problem = check_complete(folder, verify)
    if problem is not None:
        raise ValueError(problem)
    manifest = read_manifest(folder)
    trainer = _load_tensors(folder, "trainer.pt")
    drafter = None
    if (folder / "drafter" / "state.pt").is_file():
        drafter = _load_tensors(folder, "drafter/state.pt")
    elif (folder / "drafter").is_dir():
        drafter = folder / "drafter"
    value_head = _load_tensors(folder, "value_head.pt") if (folder / "value_head.pt").is_file() else None
    config = _load_text(folder, "run.yaml", yaml.safe_load) if (folder / "run.yaml").is_file() else None
    metrics = _load_text(folder, METRICS, _parse_jsonl) if (folder / METRICS).is_file() else None
    history = sorted(folder / n for n in manifest["files"] if n.startswith(HISTORY + "/"))
    return Checkpoint(folder=folder, step=manifest["step"], manifest=manifest, optimizer=trainer.get("optimizer"),
                      scheduler=trainer.get("scheduler"), value_head=value_head, drafter=drafter,
                      rng=_load_tensors(folder, "rng.pt"), state=_load_text(folder, "state.json", json.loads),
                      config=config, metrics=metrics, history=history)


def _parse_jsonl(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _load_text(folder: Path, name: str, parse):
    try:
        return parse((folder / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"checkpoint {folder}: cannot read {name} ({type(e).__name__}: {e})") from None


def _load_tensors(folder: Path, name: str):
    try:  # weights_only: a checkpoint is data, never code to run
        return torch.load(folder / name, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged file
        raise ValueError(f"checkpoint {folder}: cannot read {name} ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------------------------- housekeeping


def prune(root, keep: int) -> list[Path]:
    """Delete the checkpoints older than the newest `keep` complete ones; returns what went.
    Nothing goes while fewer than `keep` are complete."""
    checkpoints = list_checkpoints(root)
    complete = [(s, p) for s, p in checkpoints if check_complete(p, verify=False) is None]
    if len(complete) < keep:
        return []
    oldest_kept = complete[-keep][0]
    return _remove(p for s, p in checkpoints if s < oldest_kept)


def discard_after(root, step: int) -> list[Path]:
    """Delete the checkpoints of steps after `step` (a run resumed from an earlier one makes them
    another timeline's); returns what went."""
    return _remove(p for s, p in list_checkpoints(root) if s > step)


def _remove(folders: Iterable[Path]) -> list[Path]:
    """Rename each folder to a temporary name, then delete it: a kill in between leaves a
    temporary (removed by the next save), never a half-deleted checkpoint."""
    gone = []
    for p in folders:
        aside = p.parent / f".{p.name}.{_host()}.{os.getpid()}.gone{TMP_SUFFIX}"
        try:
            os.rename(p, aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
        gone.append(p)
    return gone


def remove_stale_temporaries(root) -> None:
    """Remove temporary folders of writers that are gone: dead processes of this host, or too old."""
    now = time.time()
    for entry in os.scandir(root):
        m = _TMP_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            dead = m.group("host") == _host() and not _alive(int(m.group("pid")))
            if dead or now - entry.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))
