"""The rollout history store: past responses, one Parquet file per epoch, looked up by prompt
identity and sample index to serve as next epoch's drafts (history reuse).

A prompt is identified by `prompt_key(prompt_ids)`, a blake2b hash of its token ids as int32
little-endian bytes — never the decoded text, which different token sequences can share. The
prompt ids themselves are stored too and compared on every lookup, so a hash collision or a
damaged row can only cost reuse, never hand out another prompt's response.

Files are written atomically (a temporary file in the same folder, fsync, os.replace), then the
store prunes: it keeps the newest `keep_epochs` epochs and, with `max_bytes`, deletes the oldest
files until the rest fit. Reading is forgiving: a missing, truncated, garbled or foreign file
logs a warning and is treated as empty (no reuse from it). Parquet page checksums are written
and verified, so damaged data pages are detected rather than decoded into wrong tokens — and a
wrong draft would still only cost speed: the engine verifies every drafted token.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollout.seeds import prompt_key

from .atomic_file import TMP_SUFFIX, atomic_path

logger = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("prompt_key", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("sample_index", pa.int64()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("seed", pa.uint64()),
        ("epoch", pa.int64()),
        ("reward", pa.float64()),
    ],
    metadata={b"spectail.history": b"1"},
)
_FILE_RE = re.compile(r"^epoch-(\d+)\.parquet$")
_STALE_TMP_SECONDS = 3600.0


@dataclass
class HistoryRecord:
    prompt_ids: list[int]
    sample_index: int
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    seed: int = 0
    epoch: Optional[int] = None  # filled in by write_epoch
    reward: Optional[float] = None


@dataclass
class _Loaded:
    signature: tuple  # (mtime_ns, size) of the file when read
    table: Optional[pa.Table]
    rows: dict  # (prompt_key, sample_index) -> row


class HistoryStore:
    """Past rollouts under `root_dir`, one `epoch-NNNNNNNNN.parquet` per epoch.

    keep_epochs: newest epochs kept after each write (None: all).
    max_bytes: after each write, oldest files are deleted until the total size is at most
        this (None: no bound); this may delete the file just written if it alone is larger.
    """

    def __init__(self, root_dir: Union[str, os.PathLike], keep_epochs: Optional[int] = 2,
                 max_bytes: Optional[int] = None):
        if keep_epochs is not None and (int(keep_epochs) != keep_epochs or keep_epochs < 1):
            raise ValueError(f"HistoryStore.keep_epochs must be an integer >= 1 or None, got {keep_epochs}")
        if max_bytes is not None and (int(max_bytes) != max_bytes or max_bytes < 0):
            raise ValueError(f"HistoryStore.max_bytes must be an integer >= 0 or None, got {max_bytes}")
        self.root = Path(root_dir)
        self.keep_epochs = keep_epochs
        self.max_bytes = max_bytes
        self._cache: dict[str, _Loaded] = {}

    # -- writing ---------------------------------------------------------------------------

    def write_epoch(self, epoch: int, records: Iterable[Union[HistoryRecord, Mapping]]) -> Path:
        """Write all of an epoch's records as one file (replacing an earlier file of that
        epoch), atomically, then prune. Returns the file's path. Bad records raise ValueError
        before anything is written; a later record with the same (prompt, sample index) wins."""
        if int(epoch) != epoch or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch}")
        epoch = int(epoch)
        rows = [_coerce(r, epoch) for r in records]
        cols = {name: [getattr(r, name) for r in rows] for name in SCHEMA.names if name != "prompt_key"}
        cols["prompt_key"] = [prompt_key(r.prompt_ids) for r in rows]
        try:
            table = pa.Table.from_pydict(cols, schema=SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise ValueError(f"history records do not fit the store's schema: {e}") from None

        self.root.mkdir(parents=True, exist_ok=True)
        final = self._path(epoch)
        with atomic_path(final) as tmp:
            pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
        _fsync_dir(self.root)
        self._cache.pop(str(final), None)
        self._prune()
        return final

    def _prune(self) -> None:
        files = self._files()
        doomed = []
        if self.keep_epochs is not None and len(files) > self.keep_epochs:
            doomed, files = files[: -self.keep_epochs], files[-self.keep_epochs :]
        if self.max_bytes is not None:
            sized = [(e, p, _size(p)) for e, p in files]
            total = sum(s for _, _, s in sized)
            while sized and total > self.max_bytes:
                e, p, s = sized.pop(0)
                doomed.append((e, p))
                total -= s
        for _, path in doomed:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("history store: could not delete %s: %s", path, e)
            self._cache.pop(str(path), None)
        now = time.time()
        for entry in _scandir(self.root):  # temporary files of writers that died mid-write
            if entry.name.startswith(".epoch-") and entry.name.endswith(TMP_SUFFIX):
                try:
                    if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(entry.path)
                except OSError:
                    pass

    # -- reading ---------------------------------------------------------------------------

    def epochs(self) -> list[int]:
        """Epochs that have a file, ascending (a file may still turn out unreadable)."""
        return [e for e, _ in self._files()]

    def records_for(self, prompts: Sequence[Sequence[int]], sample_indices: Sequence[int],
                    before_epoch: Optional[int] = None) -> list[Optional[HistoryRecord]]:
        """The newest stored record per (prompt, sample index), from an epoch below `before_epoch`
        if given, or None (none stored, or none readable); the files are listed once."""
        if len(prompts) != len(sample_indices):
            raise ValueError(f"records_for got {len(prompts)} prompts but {len(sample_indices)} sample indices")
        files = self._files()
        return [self._lookup(files, p, i, before_epoch) for p, i in zip(prompts, sample_indices)]

    def _lookup(self, files, prompt_ids, sample_index, before_epoch) -> Optional[HistoryRecord]:
        key = prompt_key(prompt_ids)
        want = [int(t) for t in prompt_ids]
        for epoch, path in reversed(files):
            if before_epoch is not None and epoch >= before_epoch:
                continue
            loaded = self._load(epoch, path)
            row = loaded.rows.get((key, int(sample_index)))
            if row is None:
                continue
            rec = _record_at(loaded.table, row)
            if rec is None or rec.prompt_ids != want or rec.sample_index != sample_index or rec.epoch != epoch:
                logger.warning("history store: %s row %d does not hold the record its key names; "
                               "skipped (no reuse from it)", path, row)
                continue
            return rec
        return None

    def _load(self, epoch: int, path: Path) -> _Loaded:
        try:
            st = path.stat()
        except OSError as e:
            logger.warning("history store: cannot read %s (%s); no reuse from it", path, e)
            return _Loaded((None, None), None, {})
        signature = (st.st_mtime_ns, st.st_size)
        cached = self._cache.get(str(path))
        if cached is not None and cached.signature == signature:
            return cached
        try:
            table = pq.read_table(path, page_checksum_verification=True)
            meta = table.schema.metadata or {}
            if meta.get(b"spectail.history") != SCHEMA.metadata[b"spectail.history"]:
                raise ValueError("not a spectail history file (schema metadata missing or of another version)")
            missing = [n for n in SCHEMA.names if n not in table.column_names]
            if missing:
                raise ValueError(f"missing columns {missing}")
            table = table.select(SCHEMA.names).cast(SCHEMA)
            if table.num_rows and not pc.all(pc.equal(table.column("epoch"), epoch)).as_py():
                raise ValueError(f"its epoch column does not say {epoch}")
            keys = table.column("prompt_key").to_pylist()
            idxs = table.column("sample_index").to_pylist()
            rows = {(k, i): r for r, (k, i) in enumerate(zip(keys, idxs))}
        except Exception as e:  # pyarrow raises many types for damaged files
            logger.warning("history store: cannot read %s (%s: %s); no reuse from it", path, type(e).__name__, e)
            table, rows = None, {}
        loaded = _Loaded(signature, table, rows)
        self._cache[str(path)] = loaded
        return loaded

    # -- files -----------------------------------------------------------------------------

    def _path(self, epoch: int) -> Path:
        return self.root / f"epoch-{epoch:09d}.parquet"

    def _files(self) -> list[tuple[int, Path]]:
        files = []
        for entry in _scandir(self.root):
            m = _FILE_RE.match(entry.name)
            if m:
                files.append((int(m.group(1)), Path(entry.path)))
        files.sort()
        live = {str(p) for _, p in files}
        for stale in [p for p in self._cache if p not in live]:
            del self._cache[stale]
        return files


def _coerce(r: Union[HistoryRecord, Mapping], epoch: int) -> HistoryRecord:
    if isinstance(r, HistoryRecord):
        r = asdict(r)
    elif not isinstance(r, Mapping):
        raise ValueError(f"history records must be HistoryRecord or dicts, got {type(r).__name__}")
    unknown = set(r) - set(HistoryRecord.__dataclass_fields__)
    if unknown:
        raise ValueError(f"history record has unknown fields {sorted(unknown)}")
    try:
        rec = HistoryRecord(**r)
    except TypeError as e:
        raise ValueError(f"bad history record: {e}") from None
    if rec.epoch is not None and rec.epoch != epoch:
        raise ValueError(f"history record says epoch {rec.epoch} but is written to epoch {epoch}")
    seed = int(rec.seed)
    if not (0 <= seed < 2**64):
        raise ValueError(f"history record seed must be in [0, 2**64), got {rec.seed}")
    if int(rec.sample_index) != rec.sample_index or rec.sample_index < 0:
        raise ValueError(f"history record sample_index must be an integer >= 0, got {rec.sample_index}")
    tokens = [int(t) for t in rec.token_ids]
    logprobs = None if rec.logprobs is None else [float(x) for x in rec.logprobs]
    if logprobs is not None and len(logprobs) != len(tokens):
        raise ValueError(f"history record has {len(tokens)} tokens but {len(logprobs)} logprobs")
    return HistoryRecord(
        prompt_ids=[int(t) for t in rec.prompt_ids], sample_index=int(rec.sample_index), token_ids=tokens,
        logprobs=logprobs, seed=seed, epoch=epoch, reward=None if rec.reward is None else float(rec.reward),
    )


def _record_at(table: pa.Table, row: int) -> Optional[HistoryRecord]:
    d = {name: table.column(name)[row].as_py() for name in SCHEMA.names}
    if d["prompt_ids"] is None or d["token_ids"] is None or d["sample_index"] is None or d["epoch"] is None:
        return None
    if d["logprobs"] is not None and (len(d["logprobs"]) != len(d["token_ids"]) or None in d["logprobs"]):
        return None
    if None in d["prompt_ids"] or any(t is None or t < 0 for t in d["token_ids"]):
        return None  # (a foreign writer's nulls inside a list: no such record was ever written)
    del d["prompt_key"]
    d["seed"] = d["seed"] or 0
    return HistoryRecord(**d)


def _scandir(root: Path):
    try:
        with os.scandir(root) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        logger.warning("history store: cannot list %s (%s); no reuse", root, e)
        return []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
