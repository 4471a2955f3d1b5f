"""The rollout history store: for each (prompt, sample index), the newest response any step
wrote, to draft the next rollout of that sample (history reuse), on a data set of any size.

    store = HistoryStore("runs/x/history")                      # max_bytes=8 GiB, no age limit
    found = store.records_for(prompt_ids, sample_indices, before_step=12)   # HistoryRecord or None
    store.write_step(12, records)

A prompt is keyed by a hash of its token ids (never the decoded text); the ids are stored too and
compared on every lookup, so a collision costs reuse, never another prompt's response. One
Parquet file per step (history_file.py), never modified; an in-memory index (history_index.py)
makes a lookup O(requests). One process writes a folder.
Its bounds and forgiving reads: docs/architecture.md, "On Ray".
"""
from __future__ import annotations

import collections
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.core.seeds import prompt_key

from .atomic_file import TMP_SUFFIX, atomic_path, fsync_dir, link_or_copy, remove_stale
from .history_file import KEY_COLUMNS, SCHEMA, HistoryRecord, coerce, read_file, record_at, rows_of
from .history_index import HistoryIndex, Key

__all__ = ["HistoryRecord", "HistoryStore", "SCHEMA", "KEY_COLUMNS", "restore_files"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 2**30
CACHE_BYTES = 256 * 2**20  # loaded files kept in memory between lookups
_FILE_RE = re.compile(r"^step-(\d+)\.parquet$")
_STALE_TMP_SECONDS = 3600.0


@dataclass
class _File:
    path: Path
    signature: tuple  # (mtime_ns, size) when indexed
    size: int


class HistoryStore:
    """The newest response per (prompt, sample index) under `root_dir` (module docstring).

    max_bytes: the files' total size after each write (None: no bound).
    max_age_steps: a record drafts steps up to this many after its own (None: no limit).
    """

    def __init__(self, root_dir: Union[str, os.PathLike], max_bytes: Optional[int] = DEFAULT_MAX_BYTES,
                 max_age_steps: Optional[int] = None):
        if max_bytes is not None and (isinstance(max_bytes, bool) or int(max_bytes) != max_bytes or max_bytes < 0):
            raise ValueError(f"HistoryStore.max_bytes must be an integer >= 0 or None, got {max_bytes!r}")
        if max_age_steps is not None and (isinstance(max_age_steps, bool) or int(max_age_steps) != max_age_steps
                                          or max_age_steps < 1):
            raise ValueError(f"HistoryStore.max_age_steps must be an integer >= 1 or None, got {max_age_steps!r}")
        self.root = Path(root_dir)
        self.max_bytes = max_bytes
        self.max_age_steps = max_age_steps
        self._files: Optional[dict[int, _File]] = None  # None until the folder is first read
        self._index = HistoryIndex()
        self._cache: collections.OrderedDict[int, tuple[tuple, pa.Table]] = collections.OrderedDict()
        self._bad: dict[int, tuple] = {}  # step -> signature of a file that could not be read

    # -- writing ---------------------------------------------------------------------------

    def write_step(self, step: int, records: Iterable[Union[HistoryRecord, Mapping]]) -> Optional[Path]:
        """Write a step's records as one file (replacing an earlier file of that step),
        atomically, then apply the bounds. Returns the file's path (None for no records, which
        removes that step's file). Bad records raise ValueError before anything is written; a
        later record with the same (prompt, sample index) wins."""
        if isinstance(step, bool) or int(step) != step or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        coerced = (coerce(r, step) for r in records)
        rows = list({(prompt_key(r.prompt_ids), r.sample_index): r for r in coerced}.items())  # the last one wins
        cols = {name: [getattr(r, name) for _, r in rows] for name in SCHEMA.names if name != "prompt_key"}
        cols["prompt_key"] = [k for (k, _), _ in rows]
        try:
            table = pa.Table.from_pydict(cols, schema=SCHEMA)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise ValueError(f"history records do not fit the store's schema: {e}") from None
        files = self._open()
        if not rows:
            self._delete(step)
            return None
        final = self.root / f"step-{step:09d}.parquet"
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(final) as tmp:
            pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)
        fsync_dir(self.root)
        signature = _signature(final) or (None, 0)
        files[step] = _File(final, signature, signature[1])
        self._bad.pop(step, None)
        self._remember(step, signature, table)
        dead = self._index.put(step, {key: i for i, (key, _) in enumerate(rows)})
        self._apply_bounds(step, dead)
        return final if step in files else None

    def _apply_bounds(self, written: int, dead: set[int]) -> None:
        files = self._files
        doomed = set(dead)
        if self.max_age_steps is not None:
            oldest_usable = max(files) + 1 - self.max_age_steps
            doomed.update(s for s in files if s < oldest_usable)
        for step in doomed:
            self._delete(step)
        if self.max_bytes is not None:
            total = self.total_bytes()
            newest_first = sorted((s for s in files if s != written), reverse=True) + [written]
            for step in newest_first:
                if total <= self.max_bytes:
                    break
                total -= files[step].size
                self._delete(step)
        fsync_dir(self.root)

    def _delete(self, step: int) -> None:
        f = self._files.pop(step, None)
        self._index.drop(step)
        self._cache.pop(step, None)
        self._bad.pop(step, None)
        if f is None:
            return
        try:
            f.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("history store: could not delete %s: %s", f.path, e)

    def clear(self) -> None:
        """Delete every file of the store (say an earlier run's, whose step numbers this run reuses)."""
        for step in list(self._open()):
            self._delete(step)

    # -- reading ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps that have a file, ascending (a file may still turn out unreadable)."""
        return sorted(self._open())

    def files(self) -> list[Path]:
        """The store's files, oldest step first (what a checkpoint links to restore it later)."""
        return [self._files[s].path for s in sorted(self._open())]

    def total_bytes(self) -> int:
        return sum(f.size for f in self._open().values())

    def records_for(self, prompts: Sequence[Sequence[int]], sample_indices: Sequence[int],
                    before_step: Optional[int] = None) -> list[Optional[HistoryRecord]]:
        """The newest stored record per (prompt, sample index) from a step below `before_step`
        (and within max_age_steps of it), or None (none stored, or none readable)."""
        if len(prompts) != len(sample_indices):
            raise ValueError(f"records_for got {len(prompts)} prompts but {len(sample_indices)} sample indices")
        files = self._open()
        upto = before_step if before_step is not None else (max(files) + 1 if files else 0)
        lowest = upto - self.max_age_steps if self.max_age_steps is not None else None
        tables: dict[int, Optional[pa.Table]] = {}  # each file checked once per call
        return [self._lookup(p, int(i), before_step, lowest, tables) for p, i in zip(prompts, sample_indices)]

    def _lookup(self, prompt_ids, sample_index: int, before_step, lowest, tables) -> Optional[HistoryRecord]:
        key: Key = (prompt_key(prompt_ids), sample_index)
        want = [int(t) for t in prompt_ids]
        for step in reversed(list(self._index.candidates(key))):
            if (before_step is not None and step >= before_step) or (lowest is not None and step < lowest):
                continue
            if step not in tables:
                tables[step] = self._table(step)
            row = self._index.row(step, key)
            if tables[step] is None or row is None:
                continue
            rec = record_at(tables[step], row)
            if rec is None or rec.prompt_ids != want or rec.sample_index != sample_index or rec.step != step:
                logger.warning("history store: %s row %d does not hold the record its key names; "
                               "skipped (no reuse from it)", self._files[step].path, row)
                continue
            return rec
        return None

    def _table(self, step: int) -> Optional[pa.Table]:
        """Step's whole file, verified, or None; a file changed since it was indexed is re-indexed."""
        f = self._files.get(step)
        if f is None:
            return None
        signature = _signature(f.path)
        if signature is None:
            logger.warning("history store: %s is gone; no reuse from it", f.path)
            self._delete(step)
            return None
        if signature != f.signature:  # replaced under us: index what it holds now
            f.signature, f.size = signature, signature[1]
            self._cache.pop(step, None)
            self._bad.pop(step, None)
            table = self._read(step, signature)
            self._index.put(step, {} if table is None else rows_of(table))
            return table
        cached = self._cache.get(step)
        if cached is not None and cached[0] == signature:
            self._cache.move_to_end(step)
            return cached[1]
        return None if self._bad.get(step) == signature else self._read(step, signature)

    def _read(self, step: int, signature: tuple) -> Optional[pa.Table]:
        try:
            table = read_file(self._files[step].path, step, None)
        except Exception as e:  # pyarrow raises many types for damaged files
            logger.warning("history store: cannot read %s (%s: %s); no reuse from it",
                           self._files[step].path, type(e).__name__, e)
            self._bad[step] = signature
            return None
        self._remember(step, signature, table)
        return table

    def _remember(self, step: int, signature: tuple, table: pa.Table) -> None:
        self._cache[step] = (signature, table)
        self._cache.move_to_end(step)
        while len(self._cache) > 1 and sum(t.nbytes for _, t in self._cache.values()) > CACHE_BYTES:
            self._cache.popitem(last=False)

    # -- opening ---------------------------------------------------------------------------

    def _open(self) -> dict[int, _File]:
        """The files, indexed from their key columns the first time (stale temporaries removed)."""
        if self._files is not None:
            return self._files
        self._files = {}
        remove_stale(self.root, _is_temporary, _STALE_TMP_SECONDS)  # writers that died mid-write
        for entry in _scandir(self.root):
            m = _FILE_RE.match(entry.name)
            if m:
                self._index_file(int(m.group(1)), Path(entry.path))
        return self._files

    def _index_file(self, step: int, path: Path) -> None:
        signature = _signature(path)
        if signature is None:
            return
        self._files[step] = _File(path, signature, signature[1])
        try:
            rows = rows_of(read_file(path, step, KEY_COLUMNS))
        except Exception as e:  # pyarrow raises many types for damaged files
            logger.warning("history store: cannot read %s (%s: %s); no reuse from it", path, type(e).__name__, e)
            self._bad[step] = signature
            rows = {}
        self._index.put(step, rows)


def restore_files(root_dir: Union[str, os.PathLike], files: Sequence[Union[str, os.PathLike]]) -> None:
    """Make `root_dir` hold exactly these step files (a checkpoint's links, rl_integration/resume.py):
    the store's other files and temporaries go, each missing one is hard-linked in (copied across
    file systems) under a temporary name and renamed into place. Call it before a HistoryStore
    opens the folder."""
    root = Path(root_dir)
    want = {Path(f).name: Path(f) for f in files}
    bad = [n for n in want if not _FILE_RE.match(n)]
    if bad:
        raise ValueError(f"not history store files: {bad}")
    root.mkdir(parents=True, exist_ok=True)
    for entry in _scandir(root):
        ours = _FILE_RE.match(entry.name) or _is_temporary(entry.name)
        if ours and not (entry.name in want and _same_file(entry.path, want[entry.name])):
            os.unlink(entry.path)
    for name, src in want.items():
        dst = root / name
        if dst.exists():
            continue
        tmp = root / f".{name}.{os.getpid()}.restore{TMP_SUFFIX}"
        link_or_copy(src, tmp)
        os.replace(tmp, dst)
    fsync_dir(root)


def _is_temporary(name: str) -> bool:
    return name.startswith(".step-") and name.endswith(TMP_SUFFIX)


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _signature(path: Path) -> Optional[tuple]:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _scandir(root: Path):
    try:
        with os.scandir(root) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        logger.warning("history store: cannot list %s (%s); no reuse", root, e)
        return []
