"""End to end through the `spectail` command line at a tiny size: the demo with --compare, a
Parquet data set through the trainer's data path, PPO, and bad input that must fail by name
without leaving anything half-written."""
from __future__ import annotations

import dataclasses
import glob
import json
import os

from rl_integration import cli
from rl_integration.config import load_config
from rl_integration.dataset import save_parquet_dataset
from rl_integration.demo.task import make_problems
from rl_integration.metrics import read_jsonl
from scheduler.history_store import HistoryStore

from . import reward_helpers

DESIGN_NAMES = ("rollout_seconds", "generated_tokens", "tokens_per_second", "forward_passes",
                "accepted_per_verify", "proposed", "accepted", "reused_tokens", "spec_off_fraction",
                "tail_seconds", "worker_busy_fraction", "drafter_train_steps", "drafter_version", "reward_mean")

def lookup(store, prompt_ids, sample_index, before_step=None):
    """The store's newest record for one (prompt, sample index)."""
    return store.records_for([prompt_ids], [sample_index], before_step)[0]



def test_demo_end_to_end_with_compare(tiny_run, tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", *tiny_run, "trainer.steps=2", "--compare", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and [r["epoch"] for r in records] == [0, 1]
    for r in records:
        for name in DESIGN_NAMES:
            assert name in r, name
        assert r["tokens_identical"] is True and r["mismatched_samples"] == 0 and r["speedup"] > 0
    assert records[1]["reused_tokens"] > 0
    with open(out / "metrics.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert (out / "config.yaml").is_file()
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no temporary files left
    assert "step reward" in printed and "speedup" in printed and "tokens identical in every step" in printed
    assert "WARNING" not in printed  # the default noise is fresh every step


def test_per_sample_noise_is_warned_about(tiny_run, tmp_path, capsys):
    rc = cli.main(["demo", *tiny_run, "trainer.steps=2", "rollout.noise=per_sample", "--no-compare",
                   "--out", str(tmp_path / "ps")])
    printed = capsys.readouterr().out
    assert rc == 0 and "WARNING: rollout.noise=per_sample" in printed


def test_parquet_data_set_round_trips_through_the_trainer(tiny_run, tmp_path, capsys):
    task = load_config(None, tiny_run).task.embedded  # the tiny policy's task, other problems
    problems = make_problems(dataclasses.replace(task, num_problems=4, seed=11))
    data = tmp_path / "data" / "train.parquet"
    save_parquet_dataset(problems, data)
    out = tmp_path / "pq"
    reward_helpers.SEEN.clear()
    rc = cli.main(["train", "--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                                      "grpo_parquet.yaml"),
                   *tiny_run, "task.source=parquet", f"task.parquet.path={data}", "trainer.prompts_per_step=4",
                   "task.reward=tests.rl_integration.reward_helpers:recording", "rollout.n=2", "trainer.steps=1",
                   "output.plot=false", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    # every sample was scored against its own row's answer, and the prompts reached the engine
    assert sorted(set(a for _, a in reward_helpers.SEEN)) == sorted(set(p.answer for p in problems))
    assert len(reward_helpers.SEEN) == 1 + 8  # the probe before the first rollout, then every sample
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert record["num_samples"] == 8
    from transformers import AutoTokenizer

    folder = glob.glob(os.path.join(dict(o.split("=", 1) for o in tiny_run)["policy.cache_dir"], "policy-*"))[0]
    tok = AutoTokenizer.from_pretrained(folder)
    store = HistoryStore(out / "history")
    for p in problems:
        rec = lookup(store, tok(p.prompt)["input_ids"], 1)
        assert rec is not None and rec.reward in (0.0, 1.0)


def test_ppo_runs(tiny_run, tmp_path):
    out = tmp_path / "ppo"
    rc = cli.main(["train", "--config", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ppo.yaml"),
                   *tiny_run, "trainer.steps=2", "rollout.n=2", "output.plot=false", "--out", str(out)])
    assert rc == 0
    records = read_jsonl(out / "metrics.jsonl")
    assert len(records) == 2 and "value_clip_fraction" in records[0]


def _run(args, capsys):
    rc = cli.main(args)
    return rc, capsys.readouterr().err


def test_bad_input_fails_by_name_and_leaves_no_files(tiny_run, tmp_path, capsys):
    out = tmp_path / "bad"
    rc, err = _run(["demo", *tiny_run, "trainer.step=3", "--out", str(out)], capsys)
    assert rc == 2 and "unknown config key 'trainer.step'" in err
    rc, err = _run(["demo", *tiny_run, "trainer.epochs=3", "--out", str(out)], capsys)
    assert rc == 2 and "'trainer.epochs' was renamed 'trainer.steps'" in err
    rc, err = _run(["demo", *tiny_run, "trainer.steps=many", "--out", str(out)], capsys)
    assert rc == 2 and "'trainer.steps'" in err and "expected int" in err
    rc, err = _run(["demo", *tiny_run, "rollout.n=0", "--out", str(out)], capsys)
    assert rc == 2 and "'rollout.n' must be >= 1" in err
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("trainer:\n  steps: 1\n  optimizer: adam\n")
    rc, err = _run(["train", "--config", str(cfg_file), "--out", str(out)], capsys)
    assert rc == 2 and "unknown config key 'trainer.optimizer'" in err
    assert not out.exists()

    # a Parquet file without the configured columns: named, with the columns it does have
    import pyarrow as pa
    import pyarrow.parquet as pq
    data = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"question": ["1+2=?\n"], "label": ["3"]}), data)
    rc, err = _run(["demo", *tiny_run, "task.source=parquet", f"task.parquet.path={data}",
                    "trainer.prompts_per_step=1", "--out", str(out)], capsys)
    assert rc == 2 and "missing column(s) ['prompt', 'answer']" in err and "'question'" in err
    rc, err = _run(["demo", *tiny_run, "task.source=parquet", f"task.parquet.path={tmp_path / 'nope.parquet'}",
                    "--out", str(out)], capsys)
    assert rc == 2 and "is not a file" in err
    assert not out.exists()

    # a reward function that raises, or returns a non-number: named, with the sample; an earlier
    # run's metrics.jsonl in the same folder is left exactly as it was
    out.mkdir()
    old = json.dumps({"step": 0, "epoch": 0, "reward_mean": 0.5}) + "\n"
    (out / "metrics.jsonl").write_text(old)
    for name, words in (("raising", "raised KeyError"), ("not_a_number", "returned '1.0'")):
        rc, err = _run(["demo", *tiny_run, f"task.reward=tests.rl_integration.reward_helpers:{name}",
                        "trainer.steps=1", "rollout.n=2", "--out", str(out)], capsys)
        assert rc == 2 and f"reward_helpers:{name}" in err and words in err and "before the first rollout" in err
        assert (out / "metrics.jsonl").read_text() == old
        assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    reward_helpers.CALLS["first_call_only"] = 0  # right for the probe, a string in the run: fails in step 0
    rc, err = _run(["demo", *tiny_run, "task.reward=tests.rl_integration.reward_helpers:first_call_only",
                    "trainer.steps=1", "rollout.n=2", "--out", str(out)], capsys)
    assert rc == 1 and "returned '1.0'" in err and "sample 0 of step 0" in err
    assert (out / "metrics.jsonl").read_text() == old and sorted(os.listdir(out)) == ["metrics.jsonl"]
    rc, err = _run(["demo", *tiny_run, "task.reward=tests.rl_integration.reward_helpers:missing", "--out",
                    str(out)], capsys)
    assert rc == 2 and "cannot be imported" in err



def test_sigterm_during_the_warm_start_leaves_no_temporary_folder(tiny_run, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "rl_integration", "train", "--config", "examples/demo.yaml", *tiny_run,
            f"policy.cache_dir={cache}", "policy.embedded.sft_steps=100000", "--out", str(tmp_path / "out")]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    err_path = tmp_path / "stderr"
    # PYTHONFAULTHANDLER: a run that does not exit is aborted below and dumps every thread's stack,
    # so a rare hang names where it sits
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(str(cache / ".tmp-policy-*")):  # training has started
            assert proc.poll() is None, err_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the warm start never began"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            stacks = err_path.read_text()[-6000:]
            raise AssertionError(f"no exit within 60 s of SIGTERM; its stacks:\n{stacks}") from None
        assert code == 128 + signal.SIGTERM, err_path.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert os.listdir(cache) == []  # the temporary policy folder went with the run
