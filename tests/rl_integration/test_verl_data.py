"""verl's data and reward formats in `spectail train`: chat-message prompts through the chat
template, dotted answer keys, data_source and extra_info to a compute_score loaded from a file or
a module; bad rows, columns and rewards fail by name before any rollout."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl_integration import cli
from rl_integration.config import CustomRewardFunction, TaskSection, load_config
from rl_integration.dataset import Problem, encode_prompts, load_parquet_dataset, write_rows
from rl_integration.demo.task import make_problems
from rl_integration.demo.tokenizer import make_tokenizer
from rl_integration.metrics import read_jsonl
from rl_integration.rewards import RewardError, check_reward, resolve_reward, score
from scheduler.history_store import HistoryStore

from . import reward_helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import make_verl_parquet  # noqa: E402  (examples/ is not a package)

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}=>{% endif %}")


def scorer(path, name="compute_score"):
    return TaskSection(custom_reward_function=CustomRewardFunction(path, name))


def verl_file(path, problems, data_source="spectail/addition"):
    rows = [make_verl_parquet.verl_row(p, i, "train") for i, p in enumerate(problems)]
    for r in rows:
        r["data_source"] = data_source
    write_rows(rows, path)
    return rows


def test_verl_layout_is_read_with_dotted_answer_keys(tmp_path):
    problems = make_problems(dataclasses.replace(load_config(None).task.embedded, num_problems=5, seed=3))
    verl_file(tmp_path / "d.parquet", problems)
    loaded = load_parquet_dataset(tmp_path / "d.parquet", answer_key="reward_model.ground_truth")
    assert [p.prompt for p in loaded] == [[{"role": "user", "content": p.prompt}] for p in problems]
    assert [p.answer for p in loaded] == [p.answer for p in problems]
    assert {p.data_source for p in loaded} == {"spectail/addition"}
    assert loaded[3].extra_info == {"split": "train", "index": 3, "question": problems[3].prompt}
    # text and chat prompts side by side; a flat column literally named with a dot comes first
    pq.write_table(pa.table({"prompt": ["1+2\n", "x"], "a.b": [3, 4]}), tmp_path / "flat.parquet")
    assert [p.answer for p in load_parquet_dataset(tmp_path / "flat.parquet", answer_key="a.b")] == ["3", "4"]


@pytest.mark.parametrize("table, keys, words", [
    ({"prompt": [7], "answer": ["1"]}, {}, ["row 0", "'prompt'", "must be a string or a non-empty list of chat",
                                             "int 7"]),
    ({"prompt": [[{"role": "user"}]], "answer": ["1"]}, {}, ["row 0", "list of chat messages"]),
    ({"prompt": [["hi"]], "answer": ["1"]}, {}, ["row 0", "list of chat messages"]),
    ({"prompt": [[]], "answer": ["1"]}, {}, ["row 0", "non-empty list"]),
    ({"prompt": ["a", "b"], "answer": ["1", None]}, {}, ["row 1", "'answer'", "is null"]),
    ({"prompt": ["a"], "reward_model": [{"style": "rule"}]}, {"answer_key": "reward_model.ground_truth"},
     ["column 'reward_model' has no field 'ground_truth'", "['style']"]),
    ({"prompt": ["a"], "answer": ["1"]}, {"answer_key": "answer.x"}, ["'answer'", "not a struct"]),
    ({"question": ["a"]}, {"answer_key": "reward_model.ground_truth"},
     ["missing column(s) ['prompt', 'reward_model.ground_truth']", "'question'"]),
    ({"prompt": ["a"], "answer": ["1"], "extra_info": ["oops"]}, {}, ["row 0", "'extra_info' must be a struct"]),
])
def test_bad_rows_and_columns_are_named(tmp_path, table, keys, words):
    pq.write_table(pa.table(table), tmp_path / "bad.parquet")
    with pytest.raises(ValueError) as err:
        load_parquet_dataset(tmp_path / "bad.parquet", **keys)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="cannot be read as Parquet"):
        load_parquet_dataset(tmp_path / "text.parquet")


def test_chat_prompts_get_the_chat_template_with_a_generation_prompt():
    tok = make_tokenizer()
    problems = [Problem([{"role": "system", "content": "add"}, {"role": "user", "content": "1+2\n"}], "3"),
                Problem("1+2\n", "3")]
    chat, text = encode_prompts(tok, problems, chat_template=TEMPLATE)
    assert chat == tok("[system]add[user]1+2\n=>")["input_ids"]  # one <s>, from the template's bos_token
    assert text == tok("1+2\n")["input_ids"]
    tok.chat_template = TEMPLATE  # the tokenizer's own template when none is given
    assert encode_prompts(tok, problems) == [chat, text]
    with pytest.raises(ValueError, match="problem 0's prompt is a list of chat messages but the tokenizer has no"):
        encode_prompts(make_tokenizer(), problems)
    with pytest.raises(ValueError, match="problem 0's chat prompt cannot be rendered"):
        encode_prompts(tok, problems, chat_template="{{ raise_exception('no system role') }}")


def test_compute_score_from_a_file_or_a_module(tmp_path):
    problem = Problem([{"role": "user", "content": "1+2\n"}], "3", data_source="spectail/addition",
                      extra_info={"index": 4})
    by_file = resolve_reward(scorer(os.path.join(ROOT, "examples", "verl_reward.py")))
    assert by_file.verl_style and score(by_file, "2+1\n3+0\nanswer 3", problem) == 1.0
    assert score(by_file, "answer 4", problem) == 0.0
    for path in ("pkg://tests.rl_integration.reward_helpers", "tests.rl_integration.reward_helpers"):
        reward_helpers.VERL_SEEN.clear()
        by_module = resolve_reward(scorer(path))
        assert score(by_module, "answer 3", problem) == 1.0 and score(by_module, "x", problem) == 0.0
        assert reward_helpers.VERL_SEEN[1] == {"data_source": "spectail/addition", "solution_str": "x",
                                               "ground_truth": "3", "extra_info": {"index": 4}}  # a fresh copy
    assert problem.extra_info == {"index": 4}
    coro = resolve_reward(scorer("pkg://tests.rl_integration.reward_helpers", "async_score"))
    assert score(coro, "x", problem) == 0.5
    no_score = resolve_reward(scorer("tests.rl_integration.reward_helpers", "no_score"))
    with pytest.raises(RewardError, match="returned a dict without a numeric 'score' \\(\\['acc'\\]\\)"):
        score(no_score, "x", problem)
    with pytest.raises(ValueError, match="no_score.*when probed before the first rollout"):
        check_reward(no_score, problem)


@pytest.mark.parametrize("path, name, words", [
    ("missing_rewards.py", "compute_score", ["'missing_rewards.py' is not a file"]),
    ("pkg://no.such.module", "compute_score", ["cannot be imported", "No module named 'no'"]),
    ("tests.rl_integration.reward_helpers", "nope", ["has no 'nope'"]),
    ("tests.rl_integration.reward_helpers", "SEEN", ["'SEEN' is not callable"]),
])
def test_scorers_that_cannot_be_loaded_are_named(path, name, words):
    with pytest.raises(ValueError) as err:
        resolve_reward(scorer(path, name))
    for w in ["task.custom_reward_function.path", *words]:
        assert w in str(err.value), (w, str(err.value))


def test_a_verl_layout_data_set_trains_with_the_chat_template(tiny_run, tmp_path, capsys):
    data = tmp_path / "verl.parquet"
    assert make_verl_parquet.main([str(data), "--num-problems", "8", "--seed", "5"]) == 0
    out = tmp_path / "run"
    reward_helpers.VERL_SEEN.clear()
    rc = cli.main(["train", "--config", os.path.join(ROOT, "examples", "grpo_verl.yaml"), *tiny_run,
                   f"task.parquet.path={data}", "task.custom_reward_function.path=tests.rl_integration.reward_helpers",
                   f"policy.chat_template={json.dumps(TEMPLATE)}", "trainer.steps=2", "trainer.prompts_per_step=8",
                   "rollout.n=2", "output.plot=false", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1] and records[1]["history_found"] == 16
    rows = pq.read_table(data).to_pylist()
    seen = reward_helpers.VERL_SEEN
    assert len(seen) == 1 + 2 * 16  # the probe, then every sample of both steps
    assert {s["data_source"] for s in seen} == {"spectail/addition"}
    assert sorted({s["ground_truth"] for s in seen[1:]}) == sorted({r["reward_model"]["ground_truth"] for r in rows})
    assert sorted({s["extra_info"]["index"] for s in seen[1:]}) == list(range(8))
    # the engine saw each prompt rendered through the chat template, generation prompt included
    from transformers import PreTrainedTokenizerFast

    folder = glob.glob(os.path.join(dict(o.split("=", 1) for o in tiny_run)["policy.cache_dir"], "policy-*"))[0]
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    store = HistoryStore(out / "history")
    for r in rows:
        ids = tok(f"[user]{r['prompt'][0]['content']}=>")["input_ids"]
        assert store.records_for([ids], [1])[0] is not None, r["prompt"]


def test_the_example_config_runs_as_written(tiny_run, tmp_path, capsys):
    """examples/grpo_verl.yaml with its own scorer file and chat template (the tiny policy)."""
    data = tmp_path / "verl.parquet"
    make_verl_parquet.main([str(data), "--num-problems", "8"])
    rc = cli.main(["train", "--config", os.path.join(ROOT, "examples", "grpo_verl.yaml"), *tiny_run,
                   f"task.parquet.path={data}",
                   f"task.custom_reward_function.path={os.path.join(ROOT, 'examples', 'verl_reward.py')}",
                   "trainer.steps=1", "trainer.prompts_per_step=8", "rollout.n=2", "output.plot=false",
                   "--out", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert record["num_samples"] == 16 and 0.0 <= record["reward_mean"] <= 1.0


def test_bad_input_stops_before_any_rollout(tiny_run, tmp_path, capsys):
    out = tmp_path / "out"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+2\n"}], [{"role": "user", "content": None}]],
                             "answer": ["3", "4"]}), tmp_path / "chat.parquet")
    pq.write_table(pa.table({"prompt": ["1+2\n"], "answer": ["3"]}), tmp_path / "ok.parquet")
    cases = [
        (["task.source=parquet", f"task.parquet.path={tmp_path / 'chat.parquet'}", "trainer.prompts_per_step=1"],
         ["row 1", "'prompt' must be a string or a non-empty list of chat messages", "'content': None"]),
        (["task.source=parquet", f"task.parquet.path={tmp_path / 'ok.parquet'}", "trainer.prompts_per_step=1",
          "task.parquet.answer_key=reward_model.ground_truth"], ["missing column(s) ['reward_model.ground_truth']"]),
        (["task.reward=tests.rl_integration.reward_helpers:not_a_number"],
         ["reward_helpers:not_a_number", "returned '1.0'", "before the first rollout"]),
        (["task.custom_reward_function.path=tests.rl_integration.reward_helpers",
          "task.custom_reward_function.name=no_score"], ["no_score", "'score'", "before the first rollout"]),
        (["task.custom_reward_function.path=tests.rl_integration.reward_helpers",
          "task.reward=tests.rl_integration.reward_helpers:recording"], ["'task.reward'", "set one of the two"]),
    ]
    for overrides, words in cases:
        rc = cli.main(["demo", *tiny_run, *overrides, "--no-compare", "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2, (overrides, err)
        for w in words:
            assert w in err, (w, err)
        assert not out.exists()  # nothing written, nothing rolled out
