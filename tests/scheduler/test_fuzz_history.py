"""Property-based tests (hypothesis) of the history store against damaged files: random bytes
written into them, truncation, garbage appended, whole files replaced by random bytes, by other
Parquet files, by Parquet files of the store's own schema holding records it never wrote (nulls
inside lists, negative ids, logprobs of the wrong length, another epoch, another prompt under a
prompt's key), by a folder, and stray files beside them.

What the store promises (scheduler/history_store.py): a damaged or foreign file costs reuse,
never a wrong draft, and reading never raises. So every lookup returns None or a record exactly
as it was written for that (prompt, sample index) in an epoch before `before_epoch`, and never
one older than the newest undamaged epoch that has it.
"""
import logging
import os
import random
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.seeds import prompt_key
from scheduler.history_store import SCHEMA, HistoryRecord, HistoryStore
from tests.fuzz_counts import count

EPOCHS = 3
PROMPTS = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6, 7, 8]]
SAMPLES = 2
FUZZ = settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])


def lookup(store, prompt_ids, sample_index, before_epoch=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_epoch)[0]



def genuine(epoch: int, p: int, s: int) -> HistoryRecord:
    """What epoch `epoch` wrote for (prompt p, sample s); sample 1 of prompt 2 only from epoch 1 on."""
    n = 1 + (7 * epoch + 3 * p + s) % 9
    tokens = [(11 * epoch + 5 * p + 3 * s + j) % 97 for j in range(n)]
    return HistoryRecord(prompt_ids=PROMPTS[p], sample_index=s, token_ids=tokens,
                         logprobs=[-0.25 * ((j + epoch) % 5) for j in range(n)], seed=1000 * epoch + 10 * p + s,
                         epoch=epoch, reward=float(epoch + p))


def written(epoch: int) -> list[tuple[int, int]]:
    return [(p, s) for p in range(len(PROMPTS)) for s in range(SAMPLES) if not (p == 2 and s == 1 and epoch == 0)]


def write_store(root: Path) -> HistoryStore:
    store = HistoryStore(root, keep_epochs=None)
    for e in range(EPOCHS):
        store.write_epoch(e, [genuine(e, p, s) for p, s in written(e)])
    return store


# ---- damage ------------------------------------------------------------------------------------


def spectail_table(rows: list[dict], epoch: int) -> pa.Table:
    cols = {n: [r.get(n) for r in rows] for n in SCHEMA.names}
    cols["epoch"] = [r.get("epoch", epoch) for r in rows]
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def impostor_rows(kind: int, epoch: int) -> list[dict]:
    """Rows under real prompts' keys that the store never wrote, each invalid in its own way."""
    key, prompt = prompt_key(PROMPTS[0]), PROMPTS[0]
    base = {"prompt_key": key, "prompt_ids": prompt, "sample_index": 0, "token_ids": [1, 2], "logprobs": [-1.0, -1.0],
            "seed": 1}
    variants = [{"token_ids": [1, None]}, {"logprobs": [None, -1.0]}, {"prompt_ids": [5, None, 7]},
                {"token_ids": [1, -2]}, {"logprobs": [-1.0]}, {"epoch": epoch + 1}, {"prompt_ids": PROMPTS[1]},
                {"token_ids": None}, {"sample_index": None}]
    return [dict(base, **variants[kind % len(variants)])]


def damage(path: Path, epoch: int, kind: int, rng: random.Random) -> None:
    data = path.read_bytes()
    if kind == 0:  # bytes overwritten in place
        buf = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        path.write_bytes(bytes(buf))
    elif kind == 1:
        path.write_bytes(data[:rng.randrange(len(data))])
    elif kind == 2:
        path.write_bytes(data + rng.randbytes(rng.randint(1, 64)))
    elif kind == 3:
        path.write_bytes(rng.randbytes(rng.randint(0, 2 * len(data))))
    elif kind == 4:  # somebody else's Parquet file
        pq.write_table(pa.table({"prompt_ids": [[1, 2]], "token_ids": [[3]], "x": [1.5]}), path)
    elif kind == 5:  # our schema, records we never wrote
        pq.write_table(spectail_table(impostor_rows(rng.randrange(100), epoch), epoch), path)
    elif kind == 6:
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(b"")


def stray_files(root: Path, rng: random.Random) -> None:
    (root / "epoch-abc.parquet").write_bytes(rng.randbytes(16))
    (root / f".epoch-{rng.randrange(EPOCHS):09d}.parquet.x1.tmp").write_bytes(rng.randbytes(16))
    (root / "epoch-000000099.parquet.bak").write_bytes(b"")


# ---- the property ------------------------------------------------------------------------------


def expected_floor(damaged: set, p: int, s: int, before) -> int:
    """The newest undamaged epoch below `before` that wrote (p, s); -1 when none."""
    top = EPOCHS if before is None else min(before, EPOCHS)
    return max((e for e in range(top) if e not in damaged and (p, s) in written(e)), default=-1)


def check(rec, p: int, s: int, before, damaged: set) -> str:
    floor = expected_floor(damaged, p, s, before)
    if rec is None:
        assert floor == -1, f"no draft for ({p}, {s}) although undamaged epoch {floor} has it"
        return "none"
    assert (before is None or rec.epoch < before) and (p, s) in written(rec.epoch), rec
    want = genuine(rec.epoch, p, s)
    assert rec.prompt_ids == want.prompt_ids and rec.sample_index == s and rec.token_ids == want.token_ids, rec
    assert rec.logprobs == want.logprobs and rec.seed == want.seed, rec  # (these logprobs are exact in float32)
    assert rec.epoch >= floor, f"epoch {rec.epoch} served although undamaged epoch {floor} is newer"
    return "genuine" if rec.epoch not in damaged else "genuine from a damaged file"


@settings(FUZZ)
@given(damaged=st.dictionaries(st.integers(0, EPOCHS - 1), st.integers(0, 7), min_size=1),
       seed=st.integers(0, 2**32), strays=st.booleans(), read_first=st.booleans())
def test_damaged_files_cost_reuse_never_a_wrong_draft(damaged, seed, strays, read_first):
    rng = random.Random(seed)
    logging.getLogger("scheduler.history_store").setLevel(logging.ERROR)  # the warnings are expected here
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = write_store(root)
        if read_first:  # the store has the good files cached when they change underneath it
            store.records_for([PROMPTS[p] for p, _ in written(2)], [s for _, s in written(2)])
        for e, kind in damaged.items():
            damage(root / f"epoch-{e:09d}.parquet", e, kind, rng)
            os.utime(root / f"epoch-{e:09d}.parquet", ns=(10**18 + e, 10**18 + e))  # a new signature for sure
        if strays:
            stray_files(root, rng)
        count("HistoryStore damaged-file examples", f"{len(damaged)} of {EPOCHS} damaged")
        pairs = [(p, s) for p in range(len(PROMPTS)) for s in range(SAMPLES)]
        for before in (None, 1, 2, 3):
            for fresh in (store, HistoryStore(root, keep_epochs=None)):
                found = fresh.records_for([PROMPTS[p] for p, _ in pairs], [s for _, s in pairs], before_epoch=before)
                for (p, s), rec in zip(pairs, found):
                    count("HistoryStore lookups in those examples", check(rec, p, s, before, set(damaged)))
                    assert lookup(fresh, PROMPTS[p], s, before) == rec


def test_records_with_nulls_inside_their_lists_are_not_served(tmp_path):
    """Found by fuzzing: a null inside token_ids raised TypeError out of lookup, and one inside
    logprobs was served (the engine then raised on it)."""
    store = write_store(tmp_path)
    for kind in range(3):  # null token, null logprob, null prompt id
        pq.write_table(spectail_table(impostor_rows(kind, EPOCHS - 1), EPOCHS - 1),
                       tmp_path / f"epoch-{EPOCHS - 1:09d}.parquet")
        os.utime(tmp_path / f"epoch-{EPOCHS - 1:09d}.parquet", ns=(10**18 + kind, 10**18 + kind))
        assert lookup(store, PROMPTS[0], 0) == genuine(EPOCHS - 2, 0, 0)
