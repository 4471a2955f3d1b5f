"""The rollout history store: the newest response per (prompt token ids, sample index), whatever
step wrote it, one Parquet file per step, bounded by bytes and (if asked) by age."""
import logging
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.core.seeds import prompt_key
from scheduler import HistoryRecord, HistoryStore
from scheduler import history_store as hs

LOGGER = "scheduler.history_store"


def lookup(store, prompt_ids, sample_index, before_step=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_step)[0]


def rec(prompt, i, tokens, seed=7, reward=None):
    return HistoryRecord(prompt_ids=list(prompt), sample_index=i, token_ids=list(tokens),
                         logprobs=[-0.5 * (j % 4) for j in range(len(tokens))], seed=seed, reward=reward)


def listing(path):
    return sorted(os.listdir(path))


def name(step):
    return f"step-{step:09d}.parquet"


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
    path = store.write_step(3, [
        rec([5, 6, 7], 0, [10, 11, 12], seed=big_seed, reward=1.0),
        {"prompt_ids": [5, 6, 7], "sample_index": 1, "token_ids": [20, 21], "logprobs": None, "seed": 0},
    ])
    assert path.exists() and store.steps() == [3] and path.name == name(3)
    got = lookup(store, [5, 6, 7], 0)
    assert got == HistoryRecord([5, 6, 7], 0, [10, 11, 12], [0.0, -0.5, -1.0], big_seed, 3, 1.0)
    got = lookup(store, [5, 6, 7], 1)
    assert got.token_ids == [20, 21] and got.logprobs is None and got.reward is None and got.step == 3
    assert lookup(store, [5, 6, 7], 2) is None
    assert lookup(store, [5, 6], 0) is None
    # a fresh store (another process, a restart) indexes the same file
    assert lookup(HistoryStore(tmp_path / "h"), [5, 6, 7], 0).seed == big_seed
    table = pq.read_table(path)
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())


def test_same_text_different_ids_do_not_collide(tmp_path):
    store = HistoryStore(tmp_path)
    a, b = [15496, 995], [39, 68, 995]  # say "Hello world" tokenized two ways
    store.write_step(0, [rec(a, 0, [1, 1, 1]), rec(b, 0, [2, 2, 2])])
    assert lookup(store, a, 0).token_ids == [1, 1, 1]
    assert lookup(store, b, 0).token_ids == [2, 2, 2]
    found = store.records_for([a, b, [995]], [0, 0, 0])
    assert [None if r is None else r.token_ids for r in found] == [[1, 1, 1], [2, 2, 2], None]
    with pytest.raises(ValueError):
        store.records_for([a, b], [0])


def test_the_newest_record_whatever_step_wrote_it(tmp_path):
    """A data set 5x one step: each prompt comes back every 5 steps, and its record is there."""
    store = HistoryStore(tmp_path)
    prompts = [[100 + i] for i in range(10)]  # two per step
    for step in range(15):
        window = prompts[2 * (step % 5): 2 * (step % 5) + 2]
        if step >= 5:
            found = store.records_for(window, [0, 0], before_step=step)
            assert [r.step for r in found] == [step - 5, step - 5]
            assert [r.token_ids for r in found] == [[step - 5, p[0]] for p in window]
        store.write_step(step, [rec(p, 0, [step, p[0]]) for p in window])
    # each superseded file is gone as soon as nothing in it is the newest: one epoch's files remain
    assert store.steps() == [10, 11, 12, 13, 14] and listing(tmp_path) == [name(s) for s in range(10, 15)]


def test_before_step_and_partly_superseded_files(tmp_path):
    store = HistoryStore(tmp_path)
    p = [1, 2]
    store.write_step(0, [rec(p, 0, [10]), rec(p, 1, [11])])
    store.write_step(1, [rec(p, 0, [20])])
    assert store.steps() == [0, 1]  # step 0 still has the newest record of sample 1
    assert lookup(store, p, 0).token_ids == [20] and lookup(store, p, 0).step == 1
    assert lookup(store, p, 1).token_ids == [11]
    assert lookup(store, p, 0, before_step=1).token_ids == [10]  # superseded, still served below step 1
    assert lookup(store, p, 0, before_step=0) is None
    store.write_step(1, [rec(p, 0, [30])])  # writing a step again replaces its file
    assert lookup(store, p, 0).token_ids == [30]
    store.write_step(2, [rec(p, 1, [40])])
    assert store.steps() == [1, 2]  # now nothing in step 0's file is the newest of its key
    store.write_step(2, [])  # no records: that step's file goes, the older records serve again
    assert store.steps() == [1] and lookup(store, p, 1) is None and lookup(store, p, 0).token_ids == [30]


def test_max_age_steps(tmp_path):
    store = HistoryStore(tmp_path, max_age_steps=2)
    for step in range(5):
        store.write_step(step, [rec([9, step], 0, [step])])  # a new prompt every step
    assert store.steps() == [3, 4]  # step 5 may draft from steps 3 and 4
    assert lookup(store, [9, 4], 0, before_step=5).token_ids == [4]
    assert lookup(store, [9, 3], 0, before_step=6) is None  # 3 steps old at step 6
    assert lookup(store, [9, 4], 0, before_step=6).token_ids == [4]
    with pytest.raises(ValueError, match="max_age_steps"):
        HistoryStore(tmp_path, max_age_steps=0)


def test_max_bytes_keeps_what_it_has_so_a_cyclic_pass_still_reuses(tmp_path):
    first = HistoryStore(tmp_path / "size").write_step(0, [rec([7, i], 0, range(200)) for i in range(4)])
    size = first.stat().st_size
    store = HistoryStore(tmp_path / "h", max_bytes=int(size * 2.5))  # room for two steps of four
    windows = [[[s, i] for i in range(4)] for s in range(4)]  # a data set of 4 steps, same order each pass
    hits = []
    for step in range(12):
        window = windows[step % 4]
        hits.append(sum(r is not None for r in store.records_for(window, [0] * 4, before_step=step)))
        store.write_step(step, [rec(p, 0, range(step, step + 200)) for p in window])
        assert store.total_bytes() <= int(size * 2.5)
    # dropping the oldest would delete each step's records just before its prompts return (no
    # reuse at all); dropping the newest keeps part of the data set drafting, every pass
    assert hits[:4] == [0, 0, 0, 0] and hits[4] == 4 and sum(hits[4:8]) >= 4 and sum(hits[8:]) >= 4, hits
    tiny = HistoryStore(tmp_path / "t", max_bytes=0)
    assert tiny.write_step(3, [rec([9], 0, [1])]) is None  # a bound is a bound: nothing fits
    assert tiny.steps() == [] and lookup(tiny, [9], 0) is None and listing(tmp_path / "t") == []


def test_lookups_do_not_walk_the_files(tmp_path, monkeypatch):
    writer = HistoryStore(tmp_path)
    for step in range(40):
        writer.write_step(step, [rec([step, i], 0, [i]) for i in range(3)])
    store = HistoryStore(tmp_path)
    calls = {"read": [], "list": 0}
    real_read, real_list = hs.pq.read_table, hs._scandir

    def read(path, columns=None, **kw):
        calls["read"].append((os.path.basename(path), columns))
        return real_read(path, columns=columns, **kw)

    def scan(root):
        calls["list"] += 1
        return real_list(root)

    monkeypatch.setattr(hs.pq, "read_table", read)
    monkeypatch.setattr(hs, "_scandir", scan)
    assert lookup(store, [5, 1], 0).token_ids == [1]  # the first use indexes the key columns, once
    assert calls["list"] == 1 and len(calls["read"]) == 41
    assert all(cols == hs.KEY_COLUMNS for _, cols in calls["read"][:40])
    calls["read"].clear()
    for _ in range(3):
        found = store.records_for([[7, 0], [7, 2], [31, 1], [99, 0]], [0, 0, 0, 0])
        assert [None if r is None else r.token_ids for r in found] == [[0], [2], [1], None]
    assert calls["list"] == 1 and calls["read"] == [(name(7), None), (name(31), None)]  # then cached


def test_damaged_file_warns_and_falls_back(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = HistoryStore(tmp_path)
    p = [4, 4]
    store.write_step(0, [rec(p, 0, [1, 2, 3]), rec([8], 0, [8])])  # [8] keeps step 0's file
    bad = store.write_step(1, [rec(p, 0, [7, 8, 9])])
    for damage in ("truncated", "garbage", "empty", "wrong_schema", "foreign_parquet", "old_layout"):
        caplog.clear()
        data = bad.read_bytes()
        if damage == "truncated":
            bad.write_bytes(data[: len(data) // 2])
        elif damage == "garbage":
            bad.write_bytes(os.urandom(len(data)))
        elif damage == "empty":
            bad.write_bytes(b"")
        elif damage == "wrong_schema":  # right names, wrong types, our metadata
            t = pa.table({"prompt_key": [prompt_key(p)], "prompt_ids": [["x"]], "sample_index": [0],
                          "token_ids": [[7]], "logprobs": [[0.0]], "seed": [0], "step": [1], "reward": [0.0]})
            pq.write_table(t.replace_schema_metadata({b"spectail.history": b"2"}), bad)
        elif damage == "foreign_parquet":
            pq.write_table(pa.table({"a": [1, 2]}), bad)
        else:  # the epoch-file layout's version of the metadata
            pq.write_table(pq.read_table(tmp_path / name(0)).replace_schema_metadata({b"spectail.history": b"1"}), bad)
        for fresh in (HistoryStore(tmp_path), store):  # read it first / changed under an open store
            got = lookup(fresh, p, 0)
            assert got is not None and got.token_ids == [1, 2, 3] and got.step == 0, damage  # the older one serves
            assert lookup(fresh, p, 0, before_step=1).token_ids == [1, 2, 3]
        assert len(warnings_of(caplog)) == 2 and str(bad) in warnings_of(caplog)[0].getMessage(), damage
        lookup(store, p, 0)
        assert len(warnings_of(caplog)) == 2  # remembered, not re-read every lookup
        store.write_step(1, [rec(p, 0, [5])])  # a new file of that step is read again
        assert lookup(store, p, 0).token_ids == [5] and lookup(HistoryStore(tmp_path), p, 0).token_ids == [5]


def test_flipped_bytes_never_give_a_wrong_record(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = HistoryStore(tmp_path)
    records = [rec([3, i], 0, range(i, i + 50)) for i in range(20)]
    path = store.write_step(0, records)
    good = path.read_bytes()
    for at in range(4, len(good) - 8, max(1, len(good) // 40)):  # everywhere but the magic bytes
        bad = bytearray(good)
        bad[at] ^= 0x5A
        path.write_bytes(bytes(bad))
        os.utime(path, ns=(at, at))  # a new signature so the store re-reads it
        for r in records[::7]:
            for reader in (HistoryStore(tmp_path), store):
                got = lookup(reader, r.prompt_ids, 0)
                assert got is None or got.token_ids == r.token_ids


def test_hash_collision_is_caught_by_the_stored_ids(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(hs, "prompt_key", lambda ids: "same")
    store = HistoryStore(tmp_path)
    store.write_step(0, [rec([1], 0, [11]), rec([2], 0, [22])])
    assert lookup(store, [2], 0).token_ids == [22]
    assert lookup(store, [1], 0) is None  # its key now names [2]'s row: refused, not served
    assert warnings_of(caplog)


def test_missing_dir_and_vanished_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    root = tmp_path / "not" / "there"
    store = HistoryStore(root)
    assert store.steps() == [] and store.total_bytes() == 0
    assert lookup(store, [1], 0) is None
    assert [None if r is None else r.token_ids for r in store.records_for([[1], [2]], [0, 1])] == [None, None]
    assert not (tmp_path / "not").exists()  # reading creates nothing
    assert not warnings_of(caplog)
    store.write_step(0, [rec([1], 0, [5]), rec([2], 0, [6])])
    store.write_step(1, [rec([1], 0, [7])])
    (root / name(1)).unlink()  # deleted behind the store's back: the older record serves
    assert lookup(store, [1], 0).token_ids == [5]
    assert len(warnings_of(caplog)) == 1 and store.steps() == [0]
    os.symlink(tmp_path / "gone.parquet", root / name(2))  # a dangling link: not a file of ours
    assert lookup(HistoryStore(root), [1], 0).token_ids == [5]
    assert len(warnings_of(caplog)) == 1


def test_a_file_replaced_under_an_open_store_is_reindexed(tmp_path):
    store = HistoryStore(tmp_path)
    store.write_step(0, [rec([1], 0, [5])])
    assert lookup(store, [1], 0).token_ids == [5]
    other = HistoryStore(tmp_path / "other")
    other.write_step(0, [rec([2], 0, [6]), rec([1], 0, [8])])  # same step, other rows in other order
    os.replace(tmp_path / "other" / name(0), tmp_path / name(0))
    os.utime(tmp_path / name(0), ns=(10**18, 10**18))
    assert lookup(store, [2], 0) is None  # not indexed until the file is read again: no reuse, no error
    assert lookup(store, [1], 0).token_ids == [8]  # read again: its rows are indexed anew
    assert lookup(store, [2], 0).token_ids == [6]


def test_write_is_atomic(tmp_path, monkeypatch):
    store = HistoryStore(tmp_path)
    store.write_step(0, [rec([1], 0, [5]), rec([2], 0, [5])])
    store.write_step(1, [rec([1], 0, [6])])
    assert listing(tmp_path) == [name(0), name(1)]

    def crash(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(hs.pq, "write_table", crash)
    with pytest.raises(OSError):
        store.write_step(1, [rec([1], 0, [7])])
    monkeypatch.undo()
    assert listing(tmp_path) == [name(0), name(1)]  # no temp left
    assert lookup(store, [1], 0).token_ids == [6] and lookup(HistoryStore(tmp_path), [1], 0).token_ids == [6]


def test_stale_temp_files_are_cleaned_fresh_ones_kept(tmp_path):
    old = tmp_path / f".{name(5)}.1.abc.tmp"
    new = tmp_path / f".{name(6)}.2.def.tmp"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    past = time.time() - 3 * 3600
    os.utime(old, (past, past))
    store = HistoryStore(tmp_path)
    store.write_step(0, [rec([1], 0, [5])])
    assert not old.exists() and new.exists()
    assert store.steps() == [0]


def test_clear(tmp_path):
    store = HistoryStore(tmp_path)
    store.write_step(0, [rec([1], 0, [5])])
    store.write_step(1, [rec([2], 0, [5])])
    (tmp_path / "notes.txt").write_text("mine")
    HistoryStore(tmp_path).clear()
    assert listing(tmp_path) == ["notes.txt"]
    store.clear()
    assert store.steps() == [] and lookup(store, [1], 0) is None


def test_bad_records_are_rejected_before_writing(tmp_path):
    store = HistoryStore(tmp_path)
    bad = [
        HistoryRecord([1], 0, [1, 2], logprobs=[0.0]),  # lengths differ
        HistoryRecord([1], 0, [2**31]),  # token id outside int32
        HistoryRecord([1], 0, [1], seed=-1),
        HistoryRecord([1], -1, [1]),
        HistoryRecord([1], 0, [1], step=5),  # written to step 0
        {"prompt_ids": [1], "sample_index": 0, "token_ids": [1], "colour": "red"},
        {"prompt_ids": [1]},
    ]
    for r in bad:
        with pytest.raises(ValueError):
            store.write_step(0, [r])
    for step in (-1, 1.5, True):
        with pytest.raises(ValueError):
            store.write_step(step, [])
    with pytest.raises(ValueError):
        HistoryStore(tmp_path, max_bytes=-1)
    assert listing(tmp_path) == []


def test_duplicate_keys_the_later_record_wins(tmp_path):
    store = HistoryStore(tmp_path)
    assert store.write_step(0, []) is None and store.steps() == []
    store.write_step(1, [rec([1], 0, [5]), rec([1], 0, [6])])
    assert lookup(store, [1], 0).token_ids == [6] and pq.read_table(tmp_path / name(1)).num_rows == 1
