"""The history store's file format: one Parquet table per step, a row per (prompt, sample index)
record, with page checksums; what a record may hold (`coerce`), and what a read file must prove
before any row is served (`read_file`: this store's schema version, its columns, its step).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .history_index import Key

SCHEMA = pa.schema(
    [
        ("prompt_key", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("sample_index", pa.int64()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("seed", pa.uint64()),
        ("step", pa.int64()),
        ("reward", pa.float64()),
    ],
    metadata={b"spectail.history": b"2"},
)
KEY_COLUMNS = ["prompt_key", "sample_index", "step"]


@dataclass
class HistoryRecord:
    prompt_ids: list[int]
    sample_index: int
    token_ids: list[int]
    logprobs: Optional[list[float]] = None
    seed: int = 0
    step: Optional[int] = None  # filled in by write_step
    reward: Optional[float] = None


def read_file(path: Path, step: int, columns: Optional[list[str]]) -> pa.Table:
    """The file's table (all columns, or `columns`), checked to be this store's, of this step."""
    table = pq.read_table(path, columns=columns, page_checksum_verification=True)
    meta = table.schema.metadata or {}
    if meta.get(b"spectail.history") != SCHEMA.metadata[b"spectail.history"]:
        raise ValueError("not a spectail history file (schema metadata missing or of another version)")
    names = columns or SCHEMA.names
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise ValueError(f"missing columns {missing}")
    table = table.select(names).cast(pa.schema([SCHEMA.field(n) for n in names]))
    if table.num_rows and not pc.all(pc.equal(table.column("step"), step)).as_py():
        raise ValueError(f"its step column does not say {step}")
    return table


def rows_of(table: pa.Table) -> dict[Key, int]:
    keys = table.column("prompt_key").to_pylist()
    idxs = table.column("sample_index").to_pylist()
    return {(k, i): r for r, (k, i) in enumerate(zip(keys, idxs)) if k is not None and i is not None}


def coerce(r: Union[HistoryRecord, Mapping], step: int) -> HistoryRecord:
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
    if rec.step is not None and rec.step != step:
        raise ValueError(f"history record says step {rec.step} but is written to step {step}")
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
        logprobs=logprobs, seed=seed, step=step, reward=None if rec.reward is None else float(rec.reward),
    )


def record_at(table: pa.Table, row: int) -> Optional[HistoryRecord]:
    if row >= table.num_rows:
        return None
    d = {name: table.column(name)[row].as_py() for name in SCHEMA.names}
    if d["prompt_ids"] is None or d["token_ids"] is None or d["sample_index"] is None or d["step"] is None:
        return None
    if d["logprobs"] is not None and (len(d["logprobs"]) != len(d["token_ids"]) or None in d["logprobs"]):
        return None
    if None in d["prompt_ids"] or any(t is None or t < 0 for t in d["token_ids"]):
        return None  # (a foreign writer's nulls inside a list: no such record was ever written)
    del d["prompt_key"]
    d["seed"] = d["seed"] or 0
    return HistoryRecord(**d)
