"""The embedded task: problems, reward, tokenizer, Parquet I/O and the cached warm-started policy.
Fast: the only training is a few steps of a very small policy into a temporary cache."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rl_integration.config import PolicyConfig, TaskConfig
from rl_integration.dataset import Problem, load_parquet_dataset, save_parquet_dataset
from rl_integration.demo import policy as policy_mod
from rl_integration.demo.policy import cache_key, load_or_train_policy, sft_examples
from rl_integration.demo.task import (
    extract_answer,
    format_solution,
    make_problems,
    parse_prompt,
    reward_fn,
)
from rl_integration.demo.tokenizer import VOCAB, build_tokenizer, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_problems_are_deterministic_per_seed():
    a = make_problems(TaskConfig(num_problems=50, seed=3))
    b = make_problems(TaskConfig(num_problems=50, seed=3))
    c = make_problems(TaskConfig(num_problems=50, seed=4))
    assert a == b
    assert a != c
    assert len(a) == 50


def test_bad_configs_are_rejected_by_name():
    for bad, name in [(dict(min_count=0), "min_count"), (dict(max_start=-1), "max_start"),
                      (dict(tail_alpha=float("nan")), "tail_alpha"), (dict(num_problems=-1), "num_problems")]:
        with pytest.raises(ValueError, match=name):
            make_problems(TaskConfig(**bad))
    with pytest.raises(ValueError, match="arch"):
        load_or_train_policy(TaskConfig(), PolicyConfig(arch="gpt2"))


def test_solutions_are_correct_and_rewarded():
    cfg = TaskConfig(num_problems=200, seed=1)
    for p in make_problems(cfg):
        start, count, widths = parse_prompt(p.prompt)
        assert widths == (3, 2) and p.prompt == f"{start:03d}+{count:02d}\n"
        assert cfg.min_start <= start <= cfg.max_start and cfg.min_count <= count <= cfg.max_count
        assert p.answer == str(start + count)
        lines = p.solution.split("\n")
        assert len(lines) == count + 1 and lines[-1] == f"answer {start + count:03d}"
        for k, line in enumerate(lines[:-1], 1):  # every line moves one unit to the running total
            assert line == f"{start + k:03d}+{count - k:02d}"
        assert len({len(line) for line in lines[:-1]}) == 1  # fixed width
        assert format_solution(p.prompt) == p.solution
        assert reward_fn(p.solution, p.answer) == 1.0
    one = TaskConfig(num_problems=1, min_start=38, max_start=38, min_count=4, max_count=4)
    assert make_problems(one) == [Problem("38+4\n", "42", "39+3\n40+2\n41+1\n42+0\nanswer 42")]
    wide = make_problems(TaskConfig(num_problems=1, min_start=38, max_start=38, min_count=4, max_count=12))
    assert wide[0].prompt[:3] == "38+" and len(wide[0].prompt) == 6  # count padded to 2 digits


def test_training_solutions_slip_at_the_configured_rate():
    pcfg = PolicyConfig(sft_pool=2000)
    train = sft_examples(TaskConfig(), pcfg)
    assert train == sft_examples(TaskConfig(num_problems=5, seed=99), pcfg)  # deterministic
    assert [parse_prompt(p.prompt) for p in train] != [parse_prompt(p.prompt) for p in make_problems(TaskConfig())]
    lines = slips = 0
    for p in train:
        start, count, _ = parse_prompt(p.prompt)
        rows = p.solution.split("\n")
        assert len(rows) == count + 1 and rows[-1].startswith("answer ")
        prev = start
        for k, row in enumerate(rows[:-1], 1):
            total, left = (int(x) for x in row.split("+"))
            assert left == count - k and total - prev in (0, 1, 2)
            slips += total - prev != 1
            lines += 1
            prev = total
        assert rows[-1] == f"answer {prev:03d}"
    assert 0.08 < slips / lines < 0.12
    assert 0.15 < sum(reward_fn(p.solution, p.answer) == 0.0 for p in train) / len(train) < 0.45
    assert format_solution("38+4\n", 0.0) == "39+3\n40+2\n41+1\n42+0\nanswer 42"


def test_response_lengths_have_a_long_tail(tok):
    problems = make_problems(TaskConfig(num_problems=2000, seed=0))
    lengths = np.array([len(tok(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in problems])
    ratio = np.percentile(lengths, 99) / np.median(lengths)
    assert ratio >= 5.0, ratio
    assert lengths.max() + 10 <= PolicyConfig().max_position_embeddings  # prompt and response fit


def test_reward_right_wrong_and_garbage(tok):
    assert reward_fn("1+2=3\nanswer 3", "3") == 1.0
    assert reward_fn("answer 3", 3) == 1.0
    assert reward_fn("002+00\nanswer 003", "3") == 1.0  # zero-padded like the task's numbers
    assert reward_fn("1+2=4\nanswer 4", "3") == 0.0
    assert reward_fn("answer 33", "3") == 0.0
    assert reward_fn("answer 3\nanswer 4", "4") == 0.0  # the first answer counts: no hedging
    assert reward_fn("", "3") == 0.0
    assert reward_fn("\x00\xff garbage ans wer 3 ???", "3") == 0.0
    assert reward_fn(None, "3") == 0.0
    assert reward_fn("answer 3", "not a number") == 0.0
    assert reward_fn("answer 99999999999999999999999999", "3") == 0.0
    ids = tok("1+2=3\nanswer 3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert reward_fn(ids, "3") == 1.0
    assert reward_fn(ids, "3", tokenizer=tok) == 1.0
    assert reward_fn([10**9, -5], "3") == 0.0
    assert extract_answer("x\nanswer 007") == "7"
    assert extract_answer("no answer here") is None


def test_tokenizer_round_trips_and_loads_with_auto(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert len(tok) == len(loaded) == len(VOCAB) < 128
    for t in (tok, loaded):
        assert (t.bos_token, t.eos_token, t.pad_token) == ("<s>", "</s>", "<pad>")
        assert len({t.bos_token_id, t.eos_token_id, t.pad_token_id}) == 3
    texts = [p.prompt + p.solution for p in make_problems(TaskConfig(num_problems=100, seed=5))]
    texts += ["answer", "answers 3", "ans wer", ""]
    texts += ["  two  spaces, tabs\tand ~!@#$%^&*()_{}|:\"<>? too\n"]
    for text in texts:
        ids = loaded(text)["input_ids"]
        assert ids[0] == loaded.bos_token_id
        assert ids == tok(text)["input_ids"]
        assert loaded.decode(ids, skip_special_tokens=True) == text
    assert len(loaded("answer 5", add_special_tokens=False)["input_ids"]) == 3  # "answer" is one token


def test_parquet_round_trip_and_missing_columns(tmp_path):
    problems = make_problems(TaskConfig(num_problems=20, seed=2))
    path = tmp_path / "sub" / "train.parquet"
    save_parquet_dataset(problems, path)
    assert load_parquet_dataset(path) == problems
    assert [f for f in os.listdir(path.parent) if f.startswith(".tmp")] == []

    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"question": ["1+2=?\n"], "label": [3]}), other)
    loaded = load_parquet_dataset(other, prompt_key="question", answer_key="label")
    assert loaded == [Problem("1+2=?\n", "3", "")]
    with pytest.raises(ValueError) as err:
        load_parquet_dataset(other)
    msg = str(err.value)
    assert "'prompt'" in msg and "'answer'" in msg and "'question'" in msg and "'label'" in msg
    with pytest.raises(ValueError, match="'label'.*'question'|'question'.*'label'"):
        load_parquet_dataset(other, prompt_key="question")


def test_cache_key_ignores_problem_count_and_seed():
    p = PolicyConfig()
    assert cache_key(TaskConfig(num_problems=10, seed=1), p) == cache_key(TaskConfig(num_problems=99, seed=7), p)
    assert cache_key(TaskConfig(max_count=8), p) != cache_key(TaskConfig(), p)
    assert cache_key(TaskConfig(), PolicyConfig(sft_steps=1)) != cache_key(TaskConfig(), p)


TINY = PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                    sft_steps=3, sft_tokens_per_batch=512, sft_pool=64, warmup_steps=1, num_threads=1)


def test_policy_is_trained_once_then_loaded_from_cache(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SPECTAIL_CACHE", str(tmp_path / "env-cache"))
    task = TaskConfig(max_count=6)
    model, tok, folder = load_or_train_policy(task, TINY, progress=False)
    assert os.path.dirname(folder) == str(tmp_path / "env-cache")
    assert os.path.basename(folder).startswith("policy-")
    assert sorted(os.listdir(tmp_path / "env-cache")) == [os.path.basename(folder)]  # no temp left
    for name in ("config.json", "model.safetensors", "tokenizer.json", "spectail_sft.json"):
        assert os.path.isfile(os.path.join(folder, name)), name
    assert json.load(open(os.path.join(folder, "spectail_sft.json")))["steps"] == 3
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok)

    def no_retraining(*args, **kwargs):
        raise AssertionError("the cached policy was trained again")

    monkeypatch.setattr(policy_mod, "train_sft", no_retraining)
    model2, tok2, folder2 = load_or_train_policy(TaskConfig(max_count=6, seed=9, num_problems=3), TINY,
                                                 progress=False)
    assert folder2 == folder
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)

    hf_model = AutoModelForCausalLM.from_pretrained(folder)  # a normal Hugging Face checkpoint
    hf_tok = AutoTokenizer.from_pretrained(folder)
    assert hf_tok("1+2\n")["input_ids"] == tok("1+2\n")["input_ids"] == [1, 22, 16, 23, 100]
    ids = torch.tensor([hf_tok("1+2\n")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(hf_model(ids).logits, model(ids).logits)

    from rollout import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(folder, EngineConfig(max_batch_size=2, max_model_len=64))  # the engine loads it
    outs = engine.generate([tok("001+02\n")["input_ids"]] * 2, SamplingParams(max_tokens=8), seeds=[1, 2])
    assert all(1 <= len(o.token_ids) <= 8 for o in outs)


def test_interrupted_training_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(policy_mod, "train_sft", boom)
    with pytest.raises(KeyboardInterrupt):
        load_or_train_policy(TaskConfig(max_count=6), TINY, cache_dir=tmp_path, progress=False)
    assert os.listdir(tmp_path) == []


def test_a_killed_runs_temporary_folder_is_removed_once_stale(tmp_path):
    old, fresh = tmp_path / ".tmp-policy-dead", tmp_path / ".tmp-policy-running"
    for d in (old, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    long_ago = time.time() - policy_mod.STALE_TMP_SECONDS - 60
    os.utime(old, (long_ago, long_ago))
    (tmp_path / "policy-keep").mkdir()  # not a temporary: never touched
    os.utime(tmp_path / "policy-keep", (long_ago, long_ago))
    policy_mod.remove_stale_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".tmp-policy-running", "policy-keep"]
    policy_mod.remove_stale_temporaries(str(tmp_path / "missing"))  # no cache yet: nothing to do


def test_qwen2_policy_keeps_its_tokenizer(tmp_path):
    import dataclasses

    cfg = dataclasses.replace(TINY, arch="qwen2", sft_steps=1)
    model, tok, folder = load_or_train_policy(TaskConfig(max_count=6), cfg, cache_dir=tmp_path, progress=False)
    assert model.config.model_type == "qwen2"
    # transformers 5's AutoTokenizer would swap in Qwen2Tokenizer here; load_or_train_policy must not
    assert tok("1+2\n")["input_ids"] == [1, 22, 16, 23, 100]
