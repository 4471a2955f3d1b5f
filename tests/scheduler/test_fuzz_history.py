"""Property-based tests (hypothesis) of the history store against damaged files: random bytes
written into them, truncation, garbage appended, whole files replaced by random bytes, by other
Parquet files, by Parquet files of the store's own schema holding records it never wrote (nulls
inside lists, negative ids, logprobs of the wrong length, another step, another prompt under a
prompt's key), by a folder, and stray files beside them.

What the store promises (scheduler/history_store.py): a damaged or foreign file costs reuse,
never a wrong draft, and reading never raises. So every lookup returns None or a record exactly
as it was written for that (prompt, sample index) in a step before `before_step`, and never
one older than the newest undamaged step that has it. (Each step also writes a prompt of its
own, so no step's file is wholly superseded and deleted: older records stay to fall back on.)
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

from rollout.core.seeds import prompt_key
from scheduler.history_store import SCHEMA, HistoryRecord, HistoryStore
from tests.fuzz_counts import count

STEPS = 3
PROMPTS = [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6, 7, 8]]
OWN = [[40 + e, 41] for e in range(STEPS)]  # written by step e only
SAMPLES = 2
FUZZ = settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])


def lookup(store, prompt_ids, sample_index, before_step=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_step)[0]



def genuine(step: int, p: int, s: int) -> HistoryRecord:
    """What step `step` wrote for (prompt p, sample s); sample 1 of prompt 2 only from step 1 on."""
    n = 1 + (7 * step + 3 * p + s) % 9
    tokens = [(11 * step + 5 * p + 3 * s + j) % 97 for j in range(n)]
    return HistoryRecord(prompt_ids=PROMPTS[p], sample_index=s, token_ids=tokens,
                         logprobs=[-0.25 * ((j + step) % 5) for j in range(n)], seed=1000 * step + 10 * p + s,
                         step=step, reward=float(step + p))


def written(step: int) -> list[tuple[int, int]]:
    return [(p, s) for p in range(len(PROMPTS)) for s in range(SAMPLES) if not (p == 2 and s == 1 and step == 0)]


def write_store(root: Path) -> HistoryStore:
    store = HistoryStore(root)
    for e in range(STEPS):
        store.write_step(e, [genuine(e, p, s) for p, s in written(e)] + [HistoryRecord(OWN[e], 0, [e], step=e)])
    assert store.steps() == list(range(STEPS))
    return store


# ---- damage ------------------------------------------------------------------------------------


def spectail_table(rows: list[dict], step: int) -> pa.Table:
    cols = {n: [r.get(n) for r in rows] for n in SCHEMA.names}
    cols["step"] = [r.get("step", step) for r in rows]
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def impostor_rows(kind: int, step: int) -> list[dict]:
    """Rows under real prompts' keys that the store never wrote, each invalid in its own way."""
    key, prompt = prompt_key(PROMPTS[0]), PROMPTS[0]
    base = {"prompt_key": key, "prompt_ids": prompt, "sample_index": 0, "token_ids": [1, 2], "logprobs": [-1.0, -1.0],
            "seed": 1}
    variants = [{"token_ids": [1, None]}, {"logprobs": [None, -1.0]}, {"prompt_ids": [5, None, 7]},
                {"token_ids": [1, -2]}, {"logprobs": [-1.0]}, {"step": step + 1}, {"prompt_ids": PROMPTS[1]},
                {"token_ids": None}, {"sample_index": None}]
    return [dict(base, **variants[kind % len(variants)])]


def damage(path: Path, step: int, kind: int, rng: random.Random) -> None:
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
        pq.write_table(spectail_table(impostor_rows(rng.randrange(100), step), step), path)
    elif kind == 6:
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(b"")


def stray_files(root: Path, rng: random.Random) -> None:
    (root / "step-abc.parquet").write_bytes(rng.randbytes(16))
    (root / f".step-{rng.randrange(STEPS):09d}.parquet.x1.tmp").write_bytes(rng.randbytes(16))
    (root / "step-000000099.parquet.bak").write_bytes(b"")
    (root / "epoch-000000001.parquet").write_bytes(rng.randbytes(16))  # the old layout's name


# ---- the property ------------------------------------------------------------------------------


def expected_floor(damaged: set, p: int, s: int, before) -> int:
    """The newest undamaged step below `before` that wrote (p, s); -1 when none."""
    top = STEPS if before is None else min(before, STEPS)
    return max((e for e in range(top) if e not in damaged and (p, s) in written(e)), default=-1)


def check(rec, p: int, s: int, before, damaged: set) -> str:
    floor = expected_floor(damaged, p, s, before)
    if rec is None:
        assert floor == -1, f"no draft for ({p}, {s}) although undamaged step {floor} has it"
        return "none"
    assert (before is None or rec.step < before) and (p, s) in written(rec.step), rec
    want = genuine(rec.step, p, s)
    assert rec.prompt_ids == want.prompt_ids and rec.sample_index == s and rec.token_ids == want.token_ids, rec
    assert rec.logprobs == want.logprobs and rec.seed == want.seed, rec  # (these logprobs are exact in float32)
    assert rec.step >= floor, f"step {rec.step} served although undamaged step {floor} is newer"
    return "genuine" if rec.step not in damaged else "genuine from a damaged file"


@settings(FUZZ)
@given(damaged=st.dictionaries(st.integers(0, STEPS - 1), st.integers(0, 7), min_size=1),
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
            damage(root / f"step-{e:09d}.parquet", e, kind, rng)
            os.utime(root / f"step-{e:09d}.parquet", ns=(10**18 + e, 10**18 + e))  # a new signature for sure
        if strays:
            stray_files(root, rng)
        count("HistoryStore damaged-file examples", f"{len(damaged)} of {STEPS} damaged")
        pairs = [(p, s) for p in range(len(PROMPTS)) for s in range(SAMPLES)]
        for before in (None, 1, 2, 3):
            for fresh in (store, HistoryStore(root)):
                found = fresh.records_for([PROMPTS[p] for p, _ in pairs], [s for _, s in pairs], before_step=before)
                for (p, s), rec in zip(pairs, found):
                    count("HistoryStore lookups in those examples", check(rec, p, s, before, set(damaged)))
                    assert lookup(fresh, PROMPTS[p], s, before) == rec


def test_records_with_nulls_inside_their_lists_are_not_served(tmp_path):
    """Found by fuzzing: a null inside token_ids raised TypeError out of lookup, and one inside
    logprobs was served (the engine then raised on it)."""
    store = write_store(tmp_path)
    for kind in range(3):  # null token, null logprob, null prompt id
        pq.write_table(spectail_table(impostor_rows(kind, STEPS - 1), STEPS - 1),
                       tmp_path / f"step-{STEPS - 1:09d}.parquet")
        os.utime(tmp_path / f"step-{STEPS - 1:09d}.parquet", ns=(10**18 + kind, 10**18 + kind))
        assert lookup(store, PROMPTS[0], 0) == genuine(STEPS - 2, 0, 0)


@settings(FUZZ)
@given(writes=st.lists(st.tuples(st.integers(0, 6), st.sets(st.tuples(st.integers(0, 3), st.integers(0, 1)),
                                                             max_size=5)), min_size=1, max_size=12),
       max_age=st.one_of(st.none(), st.integers(1, 4)))
def test_any_order_of_writes_serves_the_newest_record(writes, max_age):
    """Against a model (a dict of what each step's file holds): after every write, each lookup
    gives the newest record of its key within max_age_steps of the next step, files with no
    newest record are gone, and a store opened afresh agrees."""
    keys = [([60 + p], s) for p in range(4) for s in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        store, model = HistoryStore(tmp, max_age_steps=max_age), {}
        for step, chosen in writes:
            store.write_step(step, [HistoryRecord([60 + p], s, [step, p, s]) for p, s in chosen])
            model[step] = {((60 + p,), s) for p, s in chosen}
            if not chosen:  # no records: only that step's file goes
                del model[step]
            elif max_age is not None:
                model = {e: v for e, v in model.items() if e >= max(model) + 1 - max_age}
            newest = {}
            for e in sorted(model):
                newest.update({(p, s): e for p, s in model[e]})
            model = {e: v for e, v in model.items() if e in newest.values()}
            assert store.steps() == sorted(model)
            for reader in (store, HistoryStore(tmp, max_age_steps=max_age)):
                found = reader.records_for([p for p, _ in keys], [s for _, s in keys])
                got = {(tuple(p), s): r.step for (p, s), r in zip(keys, found) if r is not None}
                assert got == newest
                assert all(r is None or r.token_ids == [r.step, r.prompt_ids[0] - 60, r.sample_index] for r in found)
        count("HistoryStore write sequences", f"{len(model)} files left")
