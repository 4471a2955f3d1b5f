"""The rollout history store: Parquet per epoch, keyed by prompt token ids and sample index."""
import logging
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.seeds import prompt_key
from scheduler import HistoryRecord, HistoryStore
from scheduler import history_store as hs

LOGGER = "scheduler.history_store"

def lookup(store, prompt_ids, sample_index, before_epoch=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_epoch)[0]



def rec(prompt, i, tokens, seed=7, reward=None):
    return HistoryRecord(prompt_ids=list(prompt), sample_index=i, token_ids=list(tokens),
                         logprobs=[-0.5 * (j % 4) for j in range(len(tokens))], seed=seed, reward=reward)


def listing(path):
    return sorted(os.listdir(path))


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_prompt_key_is_a_stable_hash_of_the_ids():
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) == prompt_key([1, 2, 3])
    assert prompt_key([1, 2, 3]) == "7e97588aca52b2355a67468567efe1c7"  # pinned: files outlive versions
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 3, 0])
    assert prompt_key([256]) != prompt_key([0, 1])
    assert prompt_key([]) != prompt_key([0])
    with pytest.raises(ValueError):
        prompt_key([2**31])


def test_round_trip(tmp_path):
    store = HistoryStore(tmp_path / "h")
    big_seed = 2**64 - 1
    path = store.write_epoch(3, [
        rec([5, 6, 7], 0, [10, 11, 12], seed=big_seed, reward=1.0),
        {"prompt_ids": [5, 6, 7], "sample_index": 1, "token_ids": [20, 21], "logprobs": None, "seed": 0},
    ])
    assert path.exists() and store.epochs() == [3]
    got = lookup(store, [5, 6, 7], 0)
    assert got == HistoryRecord([5, 6, 7], 0, [10, 11, 12], [0.0, -0.5, -1.0], big_seed, 3, 1.0)
    got = lookup(store, [5, 6, 7], 1)
    assert got.token_ids == [20, 21] and got.logprobs is None and got.reward is None and got.epoch == 3
    assert lookup(store, [5, 6, 7], 2) is None
    assert lookup(store, [5, 6], 0) is None
    # a fresh store (another process) reads the same file
    assert lookup(HistoryStore(tmp_path / "h"), [5, 6, 7], 0).seed == big_seed
    table = pq.read_table(path)
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())


def test_same_text_different_ids_do_not_collide(tmp_path):
    store = HistoryStore(tmp_path)
    a, b = [15496, 995], [39, 68, 995]  # say "Hello world" tokenized two ways
    store.write_epoch(0, [rec(a, 0, [1, 1, 1]), rec(b, 0, [2, 2, 2])])
    assert lookup(store, a, 0).token_ids == [1, 1, 1]
    assert lookup(store, b, 0).token_ids == [2, 2, 2]
    found = store.records_for([a, b, [995]], [0, 0, 0])
    assert [None if r is None else r.token_ids for r in found] == [[1, 1, 1], [2, 2, 2], None]
    with pytest.raises(ValueError):
        store.records_for([a, b], [0])


def test_newest_epoch_wins_and_before_epoch(tmp_path):
    store = HistoryStore(tmp_path, keep_epochs=3)
    p = [1, 2]
    store.write_epoch(0, [rec(p, 0, [10]), rec(p, 1, [11])])
    store.write_epoch(1, [rec(p, 0, [20])])
    assert lookup(store, p, 0).token_ids == [20] and lookup(store, p, 0).epoch == 1
    assert lookup(store, p, 1).token_ids == [11]  # only epoch 0 has sample 1
    assert lookup(store, p, 0, before_epoch=1).token_ids == [10]
    assert lookup(store, p, 0, before_epoch=0) is None
    store.write_epoch(1, [rec(p, 0, [30])])  # rewriting an epoch replaces its file
    assert lookup(store, p, 0).token_ids == [30]


def test_keep_epochs_prunes_old_files(tmp_path):
    store = HistoryStore(tmp_path, keep_epochs=2)
    for e in range(5):
        store.write_epoch(e, [rec([9], 0, [e])])
    assert store.epochs() == [3, 4]
    assert listing(tmp_path) == ["epoch-000000003.parquet", "epoch-000000004.parquet"]
    assert lookup(store, [9], 0, before_epoch=3) is None


def test_max_bytes_deletes_oldest_until_under_bound(tmp_path):
    unbounded = HistoryStore(tmp_path, keep_epochs=None)
    first = unbounded.write_epoch(0, [rec([9], i, range(200)) for i in range(4)])
    size = first.stat().st_size
    store = HistoryStore(tmp_path, keep_epochs=None, max_bytes=int(size * 2.5))
    store.write_epoch(1, [rec([9], i, range(200)) for i in range(4)])
    assert store.epochs() == [0, 1]
    store.write_epoch(2, [rec([9], i, range(200)) for i in range(4)])
    assert store.epochs() == [1, 2]
    assert sum((tmp_path / n).stat().st_size for n in listing(tmp_path)) <= int(size * 2.5)
    assert lookup(store, [9], 0).epoch == 2
    tiny = HistoryStore(tmp_path, keep_epochs=None, max_bytes=0)
    tiny.write_epoch(3, [rec([9], 0, [1])])  # a bound is a bound: nothing fits
    assert tiny.epochs() == [] and lookup(tiny, [9], 0) is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "wrong_schema", "foreign_parquet"])
def test_damaged_file_warns_and_falls_back(tmp_path, caplog, damage):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = HistoryStore(tmp_path, keep_epochs=None)
    p = [4, 4]
    store.write_epoch(0, [rec(p, 0, [1, 2, 3])])
    bad = store.write_epoch(1, [rec(p, 0, [7, 8, 9])])
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        bad.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "wrong_schema":  # right names, wrong types, our metadata
        t = pa.table({"prompt_key": [prompt_key(p)], "prompt_ids": [["x"]], "sample_index": [0],
                      "token_ids": [[7]], "logprobs": [[0.0]], "seed": [0], "epoch": [1], "reward": [0.0]})
        pq.write_table(t.replace_schema_metadata({b"spectail.history": b"1"}), bad)
    else:  # someone else's Parquet file under our name
        pq.write_table(pa.table({"a": [1, 2]}), bad)
    fresh = HistoryStore(tmp_path, keep_epochs=None)
    got = lookup(fresh, p, 0)
    assert got is not None and got.token_ids == [1, 2, 3] and got.epoch == 0  # the older epoch serves
    assert lookup(fresh, p, 0, before_epoch=1).token_ids == [1, 2, 3]
    assert len(warnings_of(caplog)) == 1 and str(bad) in warnings_of(caplog)[0].getMessage()
    lookup(fresh, p, 0)
    assert len(warnings_of(caplog)) == 1  # remembered, not re-read every lookup
    fresh.write_epoch(1, [rec(p, 0, [5])])  # a new file of that epoch is read again
    assert lookup(fresh, p, 0).token_ids == [5]


def test_flipped_bytes_never_give_a_wrong_record(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = HistoryStore(tmp_path)
    records = [rec([3, i], 0, range(i, i + 50)) for i in range(20)]
    path = store.write_epoch(0, records)
    good = path.read_bytes()
    for at in range(4, len(good) - 8, max(1, len(good) // 40)):  # everywhere but the magic bytes
        bad = bytearray(good)
        bad[at] ^= 0x5A
        path.write_bytes(bytes(bad))
        os.utime(path, ns=(at, at))  # a new signature so the store re-reads it
        for r in records[::7]:
            got = lookup(HistoryStore(tmp_path), r.prompt_ids, 0)
            assert got is None or got.token_ids == r.token_ids


def test_hash_collision_is_caught_by_the_stored_ids(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(hs, "prompt_key", lambda ids: "same")
    store = HistoryStore(tmp_path)
    store.write_epoch(0, [rec([1], 0, [11]), rec([2], 0, [22])])
    assert lookup(store, [2], 0).token_ids == [22]
    assert lookup(store, [1], 0) is None  # its key now names [2]'s row: refused, not served
    assert warnings_of(caplog)


def test_missing_dir_and_missing_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = HistoryStore(tmp_path / "not" / "there")
    assert store.epochs() == []
    assert lookup(store, [1], 0) is None
    assert [None if r is None else r.token_ids for r in store.records_for([[1], [2]], [0, 1])] == [None, None]
    assert not (tmp_path / "not").exists()  # reading creates nothing
    assert not warnings_of(caplog)
    store.write_epoch(0, [rec([1], 0, [5])])
    assert lookup(store, [1], 0).token_ids == [5]
    # a file that vanishes (here: a dangling link) between listing and reading
    os.symlink(tmp_path / "gone.parquet", tmp_path / "not" / "there" / "epoch-000000001.parquet")
    assert lookup(store, [1], 0).token_ids == [5]
    assert len(warnings_of(caplog)) == 1


def test_write_is_atomic(tmp_path, monkeypatch):
    store = HistoryStore(tmp_path)
    store.write_epoch(0, [rec([1], 0, [5])])
    store.write_epoch(1, [rec([1], 0, [6])])
    assert listing(tmp_path) == ["epoch-000000000.parquet", "epoch-000000001.parquet"]

    def crash(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(hs.pq, "write_table", crash)
    with pytest.raises(OSError):
        store.write_epoch(1, [rec([1], 0, [7])])
    monkeypatch.undo()
    assert listing(tmp_path) == ["epoch-000000000.parquet", "epoch-000000001.parquet"]  # no temp left
    assert lookup(HistoryStore(tmp_path), [1], 0).token_ids == [6]  # the old file is intact


def test_stale_temp_files_are_cleaned_fresh_ones_kept(tmp_path):
    old = tmp_path / ".epoch-000000005.parquet.1.abc.tmp"
    new = tmp_path / ".epoch-000000006.parquet.2.def.tmp"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    past = time.time() - 3 * 3600
    os.utime(old, (past, past))
    store = HistoryStore(tmp_path)
    store.write_epoch(0, [rec([1], 0, [5])])
    assert not old.exists() and new.exists()
    assert store.epochs() == [0]


def test_bad_records_are_rejected_before_writing(tmp_path):
    store = HistoryStore(tmp_path)
    bad = [
        HistoryRecord([1], 0, [1, 2], logprobs=[0.0]),  # lengths differ
        HistoryRecord([1], 0, [2**31]),  # token id outside int32
        HistoryRecord([1], 0, [1], seed=-1),
        HistoryRecord([1], -1, [1]),
        HistoryRecord([1], 0, [1], epoch=5),  # written to epoch 0
        {"prompt_ids": [1], "sample_index": 0, "token_ids": [1], "colour": "red"},
        {"prompt_ids": [1]},
    ]
    for r in bad:
        with pytest.raises(ValueError):
            store.write_epoch(0, [r])
    with pytest.raises(ValueError):
        store.write_epoch(-1, [])
    with pytest.raises(ValueError):
        HistoryStore(tmp_path, keep_epochs=0)
    with pytest.raises(ValueError):
        HistoryStore(tmp_path, max_bytes=-1)
    assert listing(tmp_path) == []


def test_empty_epoch_and_duplicate_keys(tmp_path):
    store = HistoryStore(tmp_path)
    store.write_epoch(0, [])
    assert store.epochs() == [0] and lookup(store, [1], 0) is None
    store.write_epoch(1, [rec([1], 0, [5]), rec([1], 0, [6])])  # the later record wins
    assert lookup(store, [1], 0).token_ids == [6]
