"""Checkpoints: step folders that load with transformers and with the engine, resume an
optimizer step for step, and survive a writer that fails or is killed at any point."""
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers

from rl_integration import checkpoint as C
from rl_integration.config import RunConfig
from rl_integration.config_loader import to_dict
from rl_integration.demo.tokenizer import VOCAB, make_tokenizer
from rollout import Engine, EngineConfig, SamplingParams
from tests.conftest import tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = torch.tensor([[1, 5, 9, 22, 7, 3, 40], [1, 8, 8, 30, 2, 0, 0]])


def make_run(seed: int = 0):
    model = tiny_hf_model("llama", vocab=len(VOCAB), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_step(model, opt, sched) -> None:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def save(root, step, model, opt=None, sched=None, **kw):
    return C.save_checkpoint(root, step, model, tokenizer=make_tokenizer(), optimizer=opt, scheduler=sched, **kw)


def hidden(root):
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def test_round_trip_resumes_exactly_and_loads_everywhere(tmp_path):
    model, opt, sched = make_run()
    train_step(model, opt, sched)
    head, drafter = torch.nn.Linear(48, 1), {"fc.weight": torch.randn(4, 4)}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save(tmp_path, 3, model, opt, sched, value_head=head, drafter=drafter, config=RunConfig(),
                state={"step": 3, "next_group": 17, "run_seed": 0})
    draws = (random.random(), np.random.rand(), torch.rand(2).tolist())
    assert path == tmp_path / "step-3" and C.latest_complete(tmp_path) == path and hidden(tmp_path) == []

    ckpt = C.load_checkpoint(path)
    assert ckpt.step == 3 and ckpt.state == {"step": 3, "next_group": 17, "run_seed": 0}
    assert ckpt.config == to_dict(RunConfig())
    assert torch.equal(ckpt.value_head["weight"], head.weight) and torch.equal(ckpt.drafter["fc.weight"],
                                                                               drafter["fc.weight"])
    C.restore_rng(ckpt.rng)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == draws

    # the folder is a Hugging Face checkpoint: same weights, same tokenizer
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert ckpt.load_tokenizer()("answer 12")["input_ids"] == make_tokenizer()("answer 12")["input_ids"]

    # a resumed optimizer takes the very step the uninterrupted one takes
    resumed, opt2, sched2 = make_run(seed=9)
    resumed.load_state_dict(loaded.state_dict())
    opt2.load_state_dict(ckpt.optimizer)
    sched2.load_state_dict(ckpt.scheduler)
    train_step(model, opt, sched)
    train_step(resumed, opt2, sched2)
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in model.state_dict().items())


def test_the_engine_loads_a_checkpoint_folder(tmp_path):
    model, _, _ = make_run(seed=4)
    path = save(tmp_path, 0, model)
    cfg = EngineConfig(max_batch_size=2, max_model_len=32)
    params = SamplingParams(max_tokens=8)
    want = Engine.from_pretrained(model, cfg).generate([[1, 5, 9], [1, 7]], params, seeds=[5, 6])
    got = Engine.from_pretrained(str(path), cfg).generate([[1, 5, 9], [1, 7]], params, seeds=[5, 6])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("fail_in", ["_write_rng", "_write_manifest", "_fsync_tree"])
def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    model, opt, sched = make_run()
    first = save(tmp_path, 1, model, opt, sched, state={"n": 1})

    def boom(*args, **kwargs):
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(C, fail_in, boom)
    for step in (2, 1):  # a new step, and the same step again
        with pytest.raises(RuntimeError, match="killed mid-write"):
            save(tmp_path, step, model, opt, sched, state={"n": 2})
        assert C.latest_complete(tmp_path) == first and C.load_checkpoint(first).state == {"n": 1}
        assert sorted(os.listdir(tmp_path)) == ["step-1"]  # nothing half-written, no temporaries


def test_incomplete_and_damaged_folders_are_skipped_with_reasons(tmp_path):
    model, opt, sched = make_run()
    good = save(tmp_path, 1, model, opt, sched)
    cases = {  # step: (what was done to a copy of the good one, what load_checkpoint must say)
        2: (lambda p: (p / "manifest.json").unlink(), "incomplete: no manifest.json"),
        3: (lambda p: _truncate(p / "trainer.pt", 100), "trainer.pt has 100 bytes"),
        4: (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
        5: (lambda p: _flip_byte(p / "model.safetensors"), "model.safetensors does not match its sha256"),
        6: (lambda p: (p / "rng.pt").unlink(), "lacks rng.pt"),
    }
    for step, (spoil, _) in cases.items():
        shutil.copytree(good, tmp_path / f"step-{step}")
        spoil(tmp_path / f"step-{step}")
    assert C.latest_complete(tmp_path) == good
    assert C.latest_complete(tmp_path, verify=False) == tmp_path / "step-5"  # sizes only: the flip goes unseen
    for step, (_, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            C.load_checkpoint(tmp_path / f"step-{step}")
    with pytest.raises(ValueError, match="does not exist"):
        C.load_checkpoint(tmp_path / "step-99")
    assert C.latest_complete(tmp_path / "nowhere") is None


def _truncate(path, size):
    path.write_bytes(path.read_bytes()[:size])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_keep_prunes_the_oldest_complete_ones(tmp_path):
    model = make_run()[0]
    for step in range(4):
        save(tmp_path, step, model, keep=2)
    assert [e for e, _ in C.list_checkpoints(tmp_path)] == [2, 3]
    shutil.copytree(tmp_path / "step-3", tmp_path / "step-4")
    (tmp_path / "step-4" / "manifest.json").unlink()  # an incomplete newest one does not count
    assert C.prune(tmp_path, 2) == []
    assert [e for e, _ in C.list_checkpoints(tmp_path)] == [2, 3, 4]


def test_history_files_are_linked_and_metrics_kept(tmp_path):
    store = tmp_path / "history"
    store.mkdir()
    files = [store / f"step-{s:09d}.parquet" for s in (3, 4)]
    for i, f in enumerate(files):
        f.write_bytes(b"PAR1" + bytes([i]) * 64)
    records = [{"step": 0, "loss": float("nan")}, {"step": 1, "loss": 0.5}]  # a NaN loss is a record too
    path = save(tmp_path / "ckpt", 5, make_run()[0], history=files, metrics=records)
    files[0].unlink()  # the store deletes a file the checkpoint still needs ...
    (store / "new").write_bytes(b"replaced")  # ... or writes one again (atomic_path: a new file renamed over it)
    os.replace(store / "new", files[1])
    ckpt = C.load_checkpoint(path)
    assert [p.name for p in ckpt.history] == ["step-000000003.parquet", "step-000000004.parquet"]
    assert ckpt.history[0].read_bytes() == b"PAR1" + bytes([0]) * 64
    assert ckpt.metrics[1] == records[1] and np.isnan(ckpt.metrics[0]["loss"])
    assert ckpt.manifest["files"]["history/step-000000003.parquet"]["sha256"] is None  # size only
    with pytest.raises(ValueError, match="does not exist"):
        save(tmp_path / "ckpt", 6, make_run()[0], history=[store / "step-000000009.parquet"])


def test_discard_after_and_prune_rename_a_folder_before_deleting_it(tmp_path, monkeypatch):
    model = make_run()[0]
    for step in (1, 2, 3):
        save(tmp_path, step, model)
    assert C.discard_after(tmp_path, 1) == [tmp_path / "step-2", tmp_path / "step-3"]
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [1] and hidden(tmp_path) == []
    save(tmp_path, 2, model)
    deleted = []  # rmtree never runs: as if the process were killed right before it
    monkeypatch.setattr(C.shutil, "rmtree", lambda path, **kw: deleted.append(os.path.basename(path)))
    assert C.prune(tmp_path, 1) == [tmp_path / "step-1"]
    monkeypatch.undo()
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [2]  # never a half-deleted step-1 ...
    assert deleted == hidden(tmp_path) and deleted[0].startswith(".step-1.")  # ... but a temporary (the
    # next save removes it once its writer is dead: test_kill_resume.py)


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, "step must be an integer >= 0"), ({"keep": 0}, "keep"),
    ({"state": {"x": float("nan")}}, "state must be plain JSON"), ({"state": {"x": object()}}, "state must be"),
    ({"value_head": 3}, "value_head must be a torch module or a state dict"), ({"drafter": "/no/such"}, "drafter"),
])
def test_bad_arguments_raise_and_write_nothing(tmp_path, kwargs, message):
    model = make_run()[0]
    args = {"step": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        C.save_checkpoint(tmp_path, args.pop("step"), model, **args)
    assert os.listdir(tmp_path) == []


def test_a_writer_killed_with_sigkill_leaves_the_previous_checkpoint(tmp_path):
    """A real kill, mid-write: the child saves step 0, then dies (SIGKILL) inside step 1's write."""
    script = textwrap.dedent(f"""
        import sys, time
        import rollout
        from rl_integration import checkpoint as C
        from tests.conftest import tiny_hf_model
        model = tiny_hf_model("llama", vocab=40)
        C.save_checkpoint({str(tmp_path)!r}, 0, model)
        def stall(path):
            print("writing", flush=True)
            time.sleep(120)
        C._write_rng = stall
        C.save_checkpoint({str(tmp_path)!r}, 1, model)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert C.latest_complete(tmp_path) == tmp_path / "step-0"
    assert len(hidden(tmp_path)) == 1  # the dead writer's temporary folder
    C.load_checkpoint(tmp_path / "step-0")
    C.save_checkpoint(tmp_path, 1, tiny_hf_model("llama", vocab=40))  # the next save removes it
    assert hidden(tmp_path) == [] and C.latest_complete(tmp_path) == tmp_path / "step-1"
