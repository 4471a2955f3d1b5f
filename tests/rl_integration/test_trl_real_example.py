"""examples/trl_grpo_real.py (TRL GRPO on SmolLM2-135M-Instruct x reasoning-gym) builds without
training: its arguments, its data set of chat prompts, its reward on right and wrong answers, its
rollout summary; with the real model, its trainer and one rollout whose speculative tokens equal a
plain engine's. Skipped, saying why, without reasoning_gym, trl or the model folder (`spectail
fetch smollm2`, or $SPECTAIL_SMOLLM2_DIR naming a folder)."""
from __future__ import annotations

import json
import os
import types

import pytest

pytest.importorskip("trl", reason="trl is not installed (pip install 'spectail[trl]')")
pytest.importorskip("reasoning_gym", reason="reasoning_gym is not installed (pip install reasoning-gym)")

from tests.rl_integration.conftest import load_example  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def example():
    return load_example("trl_grpo_real.py")


def real_model_dir() -> str:
    """A complete SmolLM2 folder spectail already fetched (never fetched here: that takes minutes)."""
    given = os.environ.get("SPECTAIL_SMOLLM2_DIR")
    if given:
        return given if os.path.isdir(given) else pytest.skip(f"$SPECTAIL_SMOLLM2_DIR={given} is not a folder")
    try:
        from rl_integration import real_model
    except ImportError:
        pytest.skip("rl_integration.real_model (spectail fetch) is missing; set $SPECTAIL_SMOLLM2_DIR to a folder")
    folder = real_model.default_folder("smollm2", "float32")
    if not real_model.is_complete(folder):
        pytest.skip(f"no SmolLM2 folder at {folder}: run `spectail fetch smollm2` first")
    return folder


def test_arguments_and_defaults(example):
    args = example.parse_args([])
    assert args.generation == "spectail" and args.task == example.TASK and args.task_config == example.TASK_CONFIG
    args = example.parse_args(["--generation", "trl", "--task", "chain_sum", "--task-config", '{"min_terms": 3}'])
    assert args.generation == "trl" and args.task_config == {"min_terms": 3}
    with pytest.raises(SystemExit):
        example.parse_args(["--generation", "vllm"])


def test_model_folder_from_the_flag_or_spectail_fetch(example, monkeypatch, tmp_path):
    assert example.model_dir("some/folder") == "some/folder"
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        ok = cmd[-2:] == ["fetch", "smollm2"]
        return types.SimpleNamespace(returncode=0 if ok else 1, stdout=f"fetching\n{tmp_path}\n", stderr="")

    monkeypatch.setattr(example.subprocess, "run", run)
    assert example.model_dir(None) == str(tmp_path)  # the last line spectail fetch prints
    monkeypatch.setattr(example.subprocess, "run", lambda cmd, **kw: types.SimpleNamespace(
        returncode=2, stdout="", stderr="invalid choice: 'fetch'"))
    with pytest.raises(SystemExit, match="pass --model DIR"):
        example.model_dir(None)


def test_data_set_is_chat_prompts_with_the_answer_format(example):
    dataset, problems = example.build_task("basic_arithmetic", 6, 3, example.TASK_CONFIG)
    assert len(dataset) == len(problems) == 6 and dataset["index"] == list(range(6))
    first = dataset[0]["prompt"]
    assert [m["role"] for m in first] == ["system", "user"]
    assert "<answer>" in first[0]["content"] and first[1]["content"] == problems[0]["question"]
    again, _ = example.build_task("basic_arithmetic", 6, 3, example.TASK_CONFIG)
    assert again["prompt"] == dataset["prompt"]  # a pure function of (name, size, seed, config)
    with pytest.raises(Exception, match="no_such_task"):
        example.build_task("no_such_task", 2, 0, {})


def test_reward_is_the_data_sets_score(example):
    dataset, problems = example.build_task("basic_arithmetic", 4, 0, example.TASK_CONFIG)
    reward = example.make_reward(problems)
    truth = [problems[i]["answer"] for i in range(4)]
    wrong = str(int(truth[1]) + 1)
    completions = [[{"role": "assistant", "content": f"Sure. <answer>{truth[0]}</answer>"}],
                   [{"role": "assistant", "content": f"<answer>{wrong}</answer> or {truth[1]}"}],  # the tags win
                   [{"role": "assistant", "content": f"It is {truth[2]}."}],  # no tags: the last number
                   [{"role": "assistant", "content": f"<answer>0</answer> no, <answer>{truth[3]}</answer>"}],
                   [{"role": "assistant", "content": "I cannot say."}]]
    assert reward(completions, index=[0, 1, 2, 3, 0]) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert reward([f"<answer>{truth[0]}</answer>"], index=[0]) == [1.0]  # plain-text completions too


def test_summary_puts_runs_side_by_side(example, tmp_path):
    paths = []
    for name, secs in (("trl", [3.0, 2.5]), ("spectail", [1.5, 1.25])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"generation": name, "rollout_seconds": secs, "completion_tokens": [10, 12],
                                    "reward": [0.25, 0.5]}))
        paths.append(str(path))
    lines = example.summarize(paths).splitlines()
    assert "trl" in lines[0] and "spectail" in lines[0] and len(lines) == 3
    assert lines[2].split() == ["1", "2.50", "12", "4.8", "0.500", "1.25", "12", "9.6", "0.500"]


def test_check_exact_needs_spectail(example):
    with pytest.raises(SystemExit, match="--generation spectail"):
        example.build_trainer(example.parse_args(["--generation", "trl", "--check-exact"]))  # before any model


def test_real_model_rollout_is_exact(example, tmp_path):
    """One generation (2 prompts x 4 samples, 32 tokens) through the script's trainer: the
    speculative rollout's tokens equal a plain engine's with the same seeds, and TRL scores it."""
    args = example.parse_args(["--prompts", "2", "--num-generations", "4", "--max-completion-length", "32",
                               "--size", "8", "--output-dir", str(tmp_path), "--check-exact"])
    trainer = example.build_trainer(args, model=real_model_dir())
    batch = [trainer.train_dataset[i]["prompt"] for i in (0, 1) for _ in range(4)]
    out = trainer.rollout_func(batch, trainer)
    assert trainer.rollout_func.checked == [sum(map(len, out["completion_ids"]))]
    assert len(out["completion_ids"]) == 8 and len(set(out["spectail_seed"])) == 8
    assert set(out["finish_reason"]) <= {"stop", "length"}
