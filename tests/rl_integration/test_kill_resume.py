"""A training run killed with SIGKILL resumes as if nothing happened.

A tiny run (4 steps, a checkpoint after every step) is killed at each point where it holds state
only in memory or has a file half-written -- during a rollout, during the optimizer updates,
while writing the history, metrics.jsonl, a checkpoint, and while pruning an old checkpoint --
each time resumed with `--resume auto` (the next kill comes in the resumed process), and then
run to the end. After every kill nothing on disk is corrupt; at the end every step's tokens and
rewards (those of the killed processes too), the metrics records, the history store and the
final weights are those of an uninterrupted run, bitwise: the draft budget is fixed
(min_draft_prob) and the online drafter off, so the resumed engine drafts exactly as the
uninterrupted one did (a resumed drafter starts from the checkpoint's head but not from its
feature buffer, so it drafts differently: the same tokens, other speculation counters;
test_resume.py checks that its head is saved and picked up).

The kills come from tests/rl_integration/kill_points.py, which wraps the run's functions from
outside (production code has no fault hooks). The Ray variant (Ray group) kills the driver in
the middle of a rollout and checks that its Ray processes go away.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rl_integration import checkpoint as C
from rl_integration.metrics import read_jsonl
from scheduler.history_file import read_file
from tests.rl_integration.kill_points import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "demo.yaml")
STEPS = 4
KILL_RUN = ["rollout.n=4", f"trainer.steps={STEPS}", "trainer.save_every=1", "trainer.keep_checkpoints=2",
            "rollout.engine.spec.min_draft_prob=0.3", "rollout.drafter.enabled=false", "output.plot=false"]
CHAIN = [("rollout", 1), ("optimizer", 1), ("history", 1), ("metrics", 1), ("checkpoint", 1), ("prune", 2)]
TIMED = ("seconds", "per_second", "_mb")  # wall times and memory: the only metrics that may differ


def spectail(tiny_run, out, record, *extra, kill=None, env=None):
    """The run, in a process of its own: forked from kill_points' preloaded server (the local
    runs), or a fresh interpreter with this environment (the Ray runs: Ray's processes inherit it)."""
    args = ["--record", str(record), *(["--kill", f"{kill[0]}:{kill[1]}"] if kill else [])]
    args += ["--", "train", "--config", DEMO, *tiny_run, *KILL_RUN, *extra, "--out", str(out)]
    if env is not None:
        done = subprocess.run([sys.executable, "-m", "tests.rl_integration.kill_points", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env=env)
        return done.returncode, done.stdout + done.stderr
    log = f"{record}.{uuid.uuid4().hex[:8]}.log"
    code = run_forked(args, log)
    with open(log, encoding="utf-8") as f:
        return code, f.read()


def rollouts(record) -> dict:
    """step -> every (tokens, rewards) recorded for it, in the order the processes sampled them."""
    out = defaultdict(list)
    for line in open(record, encoding="utf-8"):
        r = json.loads(line)
        out[r["step"]].append((r["tokens"], r["rewards"]))
    return dict(out)


@pytest.fixture(scope="module")
def reference(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    code, log = spectail(tiny_run, out / "run", out / "record.jsonl")
    assert code == 0, log
    return out / "run", rollouts(out / "record.jsonl")


def assert_intact(out) -> None:
    """What a kill may leave: complete files or hidden temporaries, never a damaged file."""
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(len(records)))
    root = out / "checkpoints"
    assert C.latest_complete(root) is not None
    for step, folder in C.list_checkpoints(root):  # a step-N folder is complete, or it is not there
        ckpt = C.load_checkpoint(folder, verify=True)
        assert ckpt.step == step and len(ckpt.metrics) == step and ckpt.state["client"]["step"] == step
    for path in (out / "history").glob("step-*.parquet"):
        read_file(path, int(path.stem.split("-")[1]), None)  # checksummed pages, this store's schema


def assert_same_as(out, reference) -> None:
    """Metrics (all but wall times), history files and final weights equal the uninterrupted run's."""
    ref_out, _ = reference
    got, want = read_jsonl(out / "metrics.jsonl"), read_jsonl(ref_out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(STEPS))
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if not k.endswith(TIMED)} == \
               {k: v for k, v in w.items() if not k.endswith(TIMED)}
    names = sorted(p.name for p in (ref_out / "history").glob("step-*.parquet"))
    assert sorted(p.name for p in (out / "history").glob("step-*.parquet")) == names
    for name in names:
        assert pq.read_table(out / "history" / name).equals(pq.read_table(ref_out / "history" / name))
    final, ref_final = (load_file(o / "checkpoints" / f"step-{STEPS}" / "model.safetensors") for o in (out, ref_out))
    assert final.keys() == ref_final.keys() and all(torch.equal(final[k], ref_final[k]) for k in final)


def hidden(out) -> list:
    return [os.path.join(d, n) for d, dirs, files in os.walk(out) for n in dirs + files if n.startswith(".")]


def test_killed_anywhere_a_run_resumes_to_the_same_tokens(reference, tiny_run, tmp_path):
    out, record = tmp_path / "run", tmp_path / "record.jsonl"
    for i, kill in enumerate(CHAIN):
        code, log = spectail(tiny_run, out, record, *(["--resume", "auto"] if i else []), kill=kill)
        assert code == -signal.SIGKILL, f"{kill}: {log[-2000:]}"
        assert_intact(out)
    code, log = spectail(tiny_run, out, record, "--resume", "auto")
    assert code == 0, log[-2000:]
    assert f"resuming from {out / 'checkpoints' / 'step-3'}" in log

    ref = reference[1]
    got = rollouts(record)
    assert sorted(got) == list(range(STEPS))
    for step, samples in got.items():  # every process that sampled a step sampled the same
        assert all(s == ref[step][0] for s in samples), f"step {step}"
    assert len(got[1]) == 5  # step 1 was sampled again by each process resumed from step-1
    assert_same_as(out, reference)
    assert hidden(out) == []  # the killed writers' temporaries are gone too
    assert [s for s, _ in C.list_checkpoints(out / "checkpoints")] == [STEPS - 1, STEPS]


# ------------------------------------------------------------------------------ Ray


def processes_with(marker: bytes, name: bytes = b"") -> list[int]:
    """Pids whose environment holds `marker` (the Ray processes a driver started) and whose
    command line starts with `name`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f, open(f"/proc/{pid}/cmdline", "rb") as g:
                if marker in f.read().split(b"\0") and g.read().startswith(name):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def wait_gone(marker: bytes, name: bytes = b"", timeout_s: float = 120.0) -> list[int]:
    """The pids still there after timeout_s (killed then, so that none is left running)."""
    start = time.monotonic()
    while (left := processes_with(marker, name)) and time.monotonic() < start + timeout_s:
        time.sleep(0.5)
    print(f"{(name or b'Ray').decode()} processes of the run gone after {time.monotonic() - start:.1f} s" if not left
          else f"{(name or b'Ray').decode()} processes of the run still there after {timeout_s} s: {left}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.ray
def test_ray_driver_killed_mid_rollout_leaves_no_worker_and_resumes(reference, tiny_run, tmp_path):
    pytest.importorskip("ray")
    tag = uuid.uuid4().hex
    marker = f"SPECTAIL_KILL_TEST={tag}".encode()
    # the workers inherit the driver's environment through the local Ray it starts ("local": never
    # an existing cluster of this machine)
    env = {**os.environ, "SPECTAIL_KILL_TEST": tag, "RAY_ADDRESS": "local"}
    ray_run = ["rollout.backend=ray", "rollout.num_workers=2"]
    out, record = tmp_path / "run", tmp_path / "record.jsonl"
    code, log = spectail(tiny_run, out, record, *ray_run, kill=("rollout", 1), env=env)
    assert code == -signal.SIGKILL, log[-2000:]
    assert wait_gone(marker, b"ray::RolloutWorker", timeout_s=30) == []  # the workers go with their driver
    assert_intact(out)
    code, log = spectail(tiny_run, out, record, *ray_run, "--resume", "auto", env=env)
    assert code == 0, log[-2000:]
    # and so does the rest of the local Ray the killed driver started (and the resumed one's): Ray's
    # node agents sometimes report the dead raylet to the dead GCS first, which times out after
    # 60 s (ray/_private/process_watcher.py); the resumed run's time counts towards that
    assert wait_gone(marker) == []

    ref_out, ref = reference
    got = rollouts(record)
    assert sorted(got) == list(range(STEPS))
    for step, samples in got.items():
        assert all(s == ref[step][0] for s in samples), f"step {step}"
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    # Ray places chunks by timing, so logprobs agree to float rounding only (whether a paused
    # request resumes from kept KV or prefills again), and the optimizer's steps amplify that in the
    # weights: the tokens above are the exact check
    final, ref_final = (load_file(o / "checkpoints" / f"step-{STEPS}" / "model.safetensors") for o in (out, ref_out))
    assert all(torch.allclose(final[k], ref_final[k], rtol=0, atol=1e-4) for k in final)
