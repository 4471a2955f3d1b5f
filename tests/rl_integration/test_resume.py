"""Checkpoints of a training run and resuming from them, in this process (the kills are in
test_kill_resume.py): a checkpoint is a Hugging Face folder the engine serves; a run resumed
from one ends bitwise where the uninterrupted run ends (GRPO with a KL reference, PPO with its
value head); a config that would change the run is refused naming the key."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import transformers

from rl_integration import checkpoint as C
from rl_integration import cli, resume
from rl_integration.config import RunConfig, load_config
from rl_integration.config_loader import to_dict
from rl_integration.metrics import read_jsonl
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.proposers.base import Draft
from scheduler.history_store import restore_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "demo.yaml")
COST = {"tokens": [1, 64], "seconds": [0.01, 0.02]}  # a step-cost table: no profile in a test
# the online drafter off: a resumed one starts from the saved head but not its feature buffer,
# so it would draft (not sample) differently; test_the_drafter_head_is_saved_and_resumed covers it
SMALL = ["rollout.n=4", "trainer.save_every=1", "rollout.engine.spec.min_draft_prob=0.3", "output.plot=false",
         "rollout.drafter.enabled=false"]


def train(tiny_run, out, *extra):
    return cli.main(["train", "--config", DEMO, *tiny_run, *SMALL, *extra, "--out", str(out)])


def test_a_run_checkpoint_is_a_hugging_face_folder_the_engine_serves(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny_run, out, "trainer.steps=3", "trainer.keep_checkpoints=2") == 0, capsys.readouterr().err
    assert [s for s, _ in C.list_checkpoints(out / "checkpoints")] == [2, 3]
    folder = out / "checkpoints" / "step-3"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok("12 + 2 =")["input_ids"]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    engine = Engine.from_pretrained(str(folder), EngineConfig(max_batch_size=2, max_model_len=64))
    got = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    assert want and got[:len(want)] == want  # (transformers stops at eos; the engine is not told to)

    ckpt = C.load_checkpoint(folder)
    assert ckpt.step == 3 and ckpt.state["client"]["step"] == 3 and ckpt.state["trainer"]["steps"] > 0
    assert ckpt.metrics == read_jsonl(out / "metrics.jsonl") and ckpt.config["trainer"]["steps"] == 3
    assert [p.name for p in ckpt.history] == sorted(p.name for p in (out / "history").glob("step-*.parquet"))
    assert ckpt.optimizer["state"] and ckpt.value_head is None


@pytest.mark.parametrize("algorithm", ["grpo_kl", "ppo"])
def test_a_resumed_run_ends_bitwise_where_the_uninterrupted_one_ends(tiny_run, tmp_path, capsys, algorithm):
    algo = ["trainer.algorithm=ppo"] if algorithm == "ppo" else ["trainer.kl_coef=0.05"]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert train(tiny_run, whole, *algo, "trainer.steps=3") == 0
    assert train(tiny_run, halves, *algo, "trainer.steps=2") == 0
    capsys.readouterr()
    assert train(tiny_run, halves, *algo, "trainer.steps=3", "--resume", "auto") == 0  # a longer run: allowed
    assert "resuming from" in capsys.readouterr().out
    a, b = (C.load_checkpoint(o / "checkpoints" / "step-3") for o in (whole, halves))
    wa, wb = a.load_model().state_dict(), b.load_model().state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for sa, sb in zip(a.optimizer["state"].values(), b.optimizer["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    if algorithm == "ppo":
        assert all(torch.equal(a.value_head[k], b.value_head[k]) for k in a.value_head)
    else:
        assert a.state["reference_sha256"] == b.state["reference_sha256"] is not None
    timed = ("seconds", "per_second", "_mb")  # wall times and memory
    for ra, rb in zip(read_jsonl(whole / "metrics.jsonl"), read_jsonl(halves / "metrics.jsonl"), strict=True):
        assert {k: v for k, v in ra.items() if not k.endswith(timed)} == \
               {k: v for k, v in rb.items() if not k.endswith(timed)}


def test_resume_refuses_what_would_change_the_run(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(tiny_run, out, "trainer.steps=1") == 0
    capsys.readouterr()
    cases = [  # (arguments, what the error says)
        (["rollout.temperature=0.9", "--resume", "auto"], "config key 'rollout.temperature' is 1.0 in checkpoint"),
        (["trainer.micro_batch_size=4", "--resume", "auto"], "'trainer.micro_batch_size'"),
        ([], "holds checkpoints of an earlier run (newest: step-1); continue it with --resume auto"),
        (["--resume", str(tmp_path / "nowhere")], "does not exist"),
        (["--resume", str(tmp_path)], "neither a checkpoint (step-N) folder nor holds any"),
    ]
    for args, message in cases:
        assert train(tiny_run, out, "trainer.steps=2", *args) == 2
        assert message in capsys.readouterr().err, args
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0]  # nothing was changed
    # allowed to differ: how long, how fast, where; --resume takes an output folder (its newest checkpoint)
    assert train(tiny_run, out, "trainer.steps=2", "rollout.engine.max_batch_size=16", "rollout.engine.spec=null",
                 "output.plot=true", "--resume", str(out)) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]


def test_changed_keys_follow_the_allow_list():
    base = to_dict(RunConfig())

    def changed(lenient=False, **over):
        new = to_dict(RunConfig())
        for key, value in over.items():
            node, *path, leaf = key.split("__")
            d = new[node]
            for p in path:
                d = d[p]
            d[leaf] = value
        return [k for k, _, _ in resume.changed_keys(base, new, lenient)]

    assert changed(trainer__steps=50, trainer__save_every=3, output__dir="x", rollout__num_workers=4) == []
    assert changed(rollout__engine__num_threads=2, rollout__history__max_bytes=10, task__parquet__path="p") == []
    assert changed(rollout__engine__spec=None) == []  # speculation off: the same samples, slower
    assert changed(rollout__engine__spec__lenience=2.0) == ["rollout.engine.spec.lenience"]
    assert changed(True, rollout__history__max_bytes=10) == ["rollout.history.max_bytes"]
    assert changed(trainer__lr=1e-3, rollout__seed=3, rollout__engine__dtype="bfloat16") == [
        "rollout.engine.dtype", "rollout.seed", "trainer.lr"]


def test_data_and_kl_reference_must_be_the_checkpoints(tiny_run, tmp_path):
    out = tmp_path / "run"
    assert train(tiny_run, out, "trainer.steps=1", "trainer.kl_coef=0.05") == 0
    ckpt = C.load_checkpoint(C.latest_complete(out / "checkpoints"))
    cfg = load_config(DEMO, [*tiny_run, *SMALL, "trainer.steps=1", "trainer.kl_coef=0.05", f"output.dir={out}"])
    resume.check(ckpt, cfg, ckpt.state["data_sha256"])
    with pytest.raises(ValueError, match="the data set differs"):
        resume.check(ckpt, cfg, "another data set")
    other = ckpt.load_model()  # the trained policy is not the initial one
    with pytest.raises(ValueError, match="initial policy .* is not the one checkpoint"):
        resume.load_models(ckpt, cfg, lambda: (other, None, None))
    cfg_no_kl = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, kl_coef=0.0))
    assert resume.load_models(ckpt, cfg_no_kl, lambda: pytest.fail("no reference needed"))[2] is None


def test_the_draft_budget_state_survives_json(llama_tiny):
    """What the engine's draft budget learnt comes back from state.json as it was (tuple keys
    too); an older budget's state is ignored with a warning (drafts never change tokens)."""
    spec = SpecConfig(proposers=("ngram", "suffix"), max_draft_tokens=4, step_cost=COST)
    engine = Engine.from_pretrained(llama_tiny, EngineConfig(max_batch_size=4, max_model_len=96, spec=spec))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24), seeds=[1, 2])
    learnt = engine.budget
    learnt.learn(Draft([1, 2, 3], engine.proposers[0], evidence=3), accepted=1)
    assert learnt.trials and any(isinstance(k, tuple) for k in learnt.trials)
    fresh = Engine.from_pretrained(llama_tiny, EngineConfig(max_batch_size=4, max_model_len=96, spec=spec)).budget
    fresh.load_state_dict(json.loads(json.dumps(learnt.state_dict())))
    assert (fresh.accepted, fresh.trials) == (learnt.accepted, learnt.trials)
    old = {"accepted": [], "trials": [], "emitted": [0.0, 0.0], "credit": 0.0, "cost": {}}  # the old controller's
    with pytest.warns(UserWarning, match="older format ignored"):
        fresh.load_state_dict(old)
    assert (fresh.accepted, fresh.trials) == (learnt.accepted, learnt.trials)


def test_the_history_store_comes_back_as_the_checkpoint_linked_it(tmp_path):
    store, saved = tmp_path / "history", tmp_path / "ckpt"
    store.mkdir(), saved.mkdir()
    for step, body in ((1, b"one"), (2, b"two, old")):
        (store / f"step-{step:09d}.parquet").write_bytes(body)
        os.link(store / f"step-{step:09d}.parquet", saved / f"step-{step:09d}.parquet")
    # the killed run went on: step 2 written again, step 3 written, step 1 pruned, a temporary left
    (store / "step-000000002.parquet").unlink()
    (store / "step-000000002.parquet").write_bytes(b"two, new")
    (store / "step-000000003.parquet").write_bytes(b"three")
    (store / "step-000000001.parquet").unlink()
    (store / ".step-000000004.parquet.x1y2.tmp").write_bytes(b"half")
    (store / "notes.txt").write_bytes(b"not the store's")
    restore_files(store, sorted(saved.iterdir()))
    assert sorted(p.name for p in store.iterdir()) == ["notes.txt", "step-000000001.parquet", "step-000000002.parquet"]
    assert (store / "step-000000002.parquet").read_bytes() == b"two, old"
    assert (store / "step-000000001.parquet").read_bytes() == b"one"
    with pytest.raises(ValueError, match="not history store files"):
        restore_files(store, [store / "notes.txt"])


def test_the_drafter_head_is_saved_and_resumed(tiny_run, tmp_path, capsys):
    """Local backend: the checkpoint keeps the trained head with its version; the resumed run
    drafts with it and its training goes on from that version (a fresh run would restart at 0)."""
    from drafter.export import load, read_state

    out = tmp_path / "run"
    on = ["rollout.drafter.enabled=true"]
    assert train(tiny_run, out, "trainer.steps=1", *on) == 0, capsys.readouterr().err
    ckpt = C.load_checkpoint(out / "checkpoints" / "step-1")
    assert ckpt.drafter is not None and ckpt.drafter.is_dir()
    head = load(ckpt.drafter, Engine.from_pretrained(str(ckpt.folder), EngineConfig(max_batch_size=1,
                                                                                     max_model_len=64)).model)
    assert all(torch.isfinite(t).all() for t in head.state_dict().values())
    version = read_state(ckpt.drafter)[1]
    assert version == ckpt.metrics[0]["drafter_version"] >= 1  # the warm start (0), trained between steps
    assert train(tiny_run, out, "trainer.steps=2", *on, "--resume", "auto") == 0, capsys.readouterr().err
    assert read_jsonl(out / "metrics.jsonl")[1]["drafter_version"] == version + 1


def corrupt_saved_head(folder, how: str) -> None:
    """Spoil a checkpoint's saved head as a bad save would (the manifest rewritten to match, so
    the checkpoint itself is complete)."""
    from safetensors.torch import load_file, save_file

    head = folder / "drafter"
    if how == "nan":
        w = load_file(head / "model.safetensors")
        w["fc.weight"][0, 0] = float("nan")
        save_file(w, head / "model.safetensors")
    else:  # made for another vocabulary
        config = json.loads((head / "config.json").read_text())
        config["spectail_drafter"]["vocab_size"] += 1
        (head / "config.json").write_text(json.dumps(config))
    step = C.read_manifest(folder)["step"]
    (folder / C.MANIFEST).unlink()
    C._write_manifest(folder, step)


@pytest.mark.parametrize("how", ["nan", "vocab"])
def test_a_saved_head_that_does_not_load_is_refused_with_a_warning(tiny_run, tmp_path, how):
    out = tmp_path / "run"
    assert train(tiny_run, out, "trainer.steps=1", "rollout.drafter.enabled=true") == 0
    ckpt = C.load_checkpoint(out / "checkpoints" / "step-1")
    corrupt_saved_head(ckpt.folder, how)
    ckpt = C.load_checkpoint(ckpt.folder)  # still a complete checkpoint
    cfg = load_config(DEMO, [*tiny_run, *SMALL, "rollout.drafter.enabled=true", "rollout.drafter.path=/elsewhere"])
    with pytest.warns(UserWarning, match="does not load, the resumed run starts without one"):
        assert resume.saved_drafter(ckpt, cfg, ckpt.load_model()) is None
    assert cfg.rollout.drafter.path == "/elsewhere"  # nothing changed


def test_a_resumed_run_with_a_refused_head_samples_the_same_tokens(tiny_run, tmp_path, capsys):
    good, bad = tmp_path / "good", tmp_path / "bad"
    on = ["rollout.drafter.enabled=true"]
    for out in (good, bad):
        assert train(tiny_run, out, "trainer.steps=1", *on) == 0, capsys.readouterr().err
    corrupt_saved_head(bad / "checkpoints" / "step-1", "nan")
    capsys.readouterr()
    assert train(tiny_run, good, "trainer.steps=2", *on, "--resume", "auto") == 0, capsys.readouterr().err
    with pytest.warns(UserWarning, match="does not load, the resumed run starts without one: .* NaN"):
        assert train(tiny_run, bad, "trainer.steps=2", *on, "--resume", "auto") == 0, capsys.readouterr().err
    a, b = (read_jsonl(out / "metrics.jsonl")[1] for out in (good, bad))
    assert (a["generated_tokens"], a["reward_mean"]) == (b["generated_tokens"], b["reward_mean"])
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)  # logprobs agree to float rounding
    assert a["accepted"]["drafter"] > 0 and a["drafter_version"] == 2
    assert b["accepted"].get("drafter", 0) == 0 and b["drafter_version"] == 1  # no head; then a fresh one
