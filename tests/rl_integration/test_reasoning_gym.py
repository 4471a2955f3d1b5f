"""task.source reasoning_gym: the public reasoning-gym package's problems as chat prompts, its own
scorer as the reward (plus an optional format reward), checked by name before any rollout, and
the same data in verl's Parquet layout. No model needed: the demo tokenizer with a chat template."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import reasoning_gym

from rl_integration import cli
from rl_integration import reasoning_gym_task as rgt
from rl_integration.config import CustomRewardFunction, ReasoningGymSource, TaskSection, load_config
from rl_integration.dataset import encode_prompts, load_parquet_dataset
from rl_integration.demo.tokenizer import make_tokenizer
from rl_integration.metrics import read_jsonl
from rl_integration.rewards import RewardError, check_reward, resolve_reward, score

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "grpo_real.yaml")
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}=>{% endif %}")


def source(**kw) -> ReasoningGymSource:
    return dataclasses.replace(ReasoningGymSource(size=6), **kw)


def rg_task(**kw) -> TaskSection:
    return TaskSection(source="reasoning_gym", reasoning_gym=source(**kw))


def test_problems_are_the_data_sets_items_and_deterministic_by_seed():
    rg = source(size=5, seed=3)
    problems = rgt.make_problems(rg)
    assert problems == rgt.make_problems(rg)
    assert problems != rgt.make_problems(source(size=5, seed=4))
    ds = reasoning_gym.create_dataset(rg.name, size=5, seed=3, **rg.config)
    for i, p in enumerate(problems):
        assert p.prompt == [{"role": "system", "content": rg.system_prompt},
                            {"role": "user", "content": ds[i]["question"]}]
        assert p.answer == ds[i]["answer"] and p.data_source == f"reasoning_gym/{rg.name}"
        assert p.extra_info["index"] == i
    assert all(len(p.prompt) == 1 for p in rgt.make_problems(source(system_prompt="")))


def test_chat_prompts_render_through_the_chat_template():
    problems = rgt.make_problems(source(size=2))
    ids = encode_prompts(make_tokenizer(), problems, chat_template=TEMPLATE)
    text = make_tokenizer().decode(ids[0], skip_special_tokens=True)
    assert text == f"[system]{problems[0].prompt[0]['content']}[user]{problems[0].prompt[1]['content']}=>"


def test_the_reward_is_the_data_sets_own_score_plus_the_format_reward():
    task = rg_task(format_reward=0.25, answer_extraction="strict")
    reward = resolve_reward(task)
    p = rgt.make_problems(task.reasoning_gym)[0]
    ds = reasoning_gym.create_dataset(task.reasoning_gym.name, size=6, seed=0, **task.reasoning_gym.config)
    wrong = str(int(p.answer) + 1)
    assert score(reward, f"so <answer>{p.answer}</answer>", p) == 1.25
    assert score(reward, f"<answer>{wrong}</answer>", p) == ds.score_answer(wrong, ds[0]) + 0.25 < 1.25
    assert score(reward, f"it is {p.answer}", p) == 0.0  # strict: no tags, nothing extracted, no format reward
    assert score(reward, f"<answer>{wrong}</answer> <answer>{p.answer}</answer>", p) == 1.0  # the last; not well-formed
    assert score(reward, "<answer> </answer>", p) == 0.0
    plain = rgt.make_problems(source(format_reward=0.0))[0]  # the format reward travels in each row's extra_info
    assert score(reward, f"<answer>{plain.answer}</answer>", plain) == 1.0
    check_reward(reward, p)  # the probe of the worked solution passes


def test_flexible_extraction_falls_back_to_the_last_number_without_the_format_reward():
    task = rg_task(answer_extraction="flexible")
    reward = resolve_reward(task)
    p = rgt.make_problems(task.reasoning_gym)[0]
    wrong = str(int(p.answer) + 1)
    assert score(reward, f"{wrong} is wrong; it is {p.answer}.", p) == 1.0  # no format reward
    assert score(reward, f"it is {p.answer}, not {wrong}", p) == 0.0
    assert score(reward, f"<answer>{wrong}</answer> not {p.answer}", p) == 0.1  # tags come first
    assert score(reward, "no number here", p) == 0.0
    assert rgt.extract("x 3.5 and -2 y", "flexible") == "-2" and rgt.extract("x 3.5 and -2 y") is None


def test_a_scorer_that_raises_is_a_reward_error_naming_it(monkeypatch):
    task = rg_task()
    reward = resolve_reward(task)
    p = rgt.make_problems(task.reasoning_gym)[0]
    ds = rgt._dataset(p.extra_info["name"], p.extra_info["config"], p.extra_info["seed"], p.extra_info["size"])

    def boom(answer, entry):
        raise KeyError("metadata")

    monkeypatch.setattr(ds, "score_answer", boom)
    with pytest.raises(RewardError, match=r"reasoning_gym/basic_arithmetic.*KeyError"):
        score(reward, "<answer>1</answer>", p)
    with pytest.raises(ValueError, match="before the first rollout"):
        check_reward(reward, p)


def test_a_row_whose_item_differs_is_a_reward_error():
    task = rg_task()
    p = dataclasses.replace(rgt.make_problems(task.reasoning_gym)[0], answer="not the answer")
    with pytest.raises(RewardError, match="another reasoning-gym version"):
        score(resolve_reward(task), "<answer>1</answer>", p)


@pytest.mark.parametrize("override, named", [
    ("task.reasoning_gym.name=chain_summ", r"'task.reasoning_gym.name'.*did you mean 'chain_sum'"),
    ("task.reasoning_gym.config.max_termz=2", r"'task.reasoning_gym.config.max_termz'.*max_terms.*accepts \["),
    ("task.reasoning_gym.config.seed=2", r"'task.reasoning_gym.config.seed'.*task.reasoning_gym.seed"),
    ("task.reasoning_gym.config.min_terms=9", r"'task.reasoning_gym.config'.*refuses"),
    ("task.reasoning_gym.size=0", r"'task.reasoning_gym.size' must be >= 1"),
    ("task.reasoning_gym.format_reward=-1", r"'task.reasoning_gym.format_reward'"),
    ("task.reasoning_gym.config=3", r"'task.reasoning_gym.config': expected a mapping"),
    ("task.reasoning_gym.answer_extraction=loose", r"'task.reasoning_gym.answer_extraction'"),
    ("task.reasoning_gym.seed=-1", r"'task.reasoning_gym.seed'"),
])
def test_bad_input_names_the_key_before_anything_is_written(tmp_path, capsys, override, named):
    out = tmp_path / "train.parquet"
    with pytest.raises(ValueError, match=named):
        load_config(EXAMPLE, [override])
    assert cli.main(["data", "--config", EXAMPLE, override, "--out", str(out)]) == 2
    assert "spectail: error: config key" in capsys.readouterr().err and not out.exists()


def test_the_example_config_loads_with_dotted_overrides_into_the_data_sets_config():
    cfg = load_config(EXAMPLE, ["policy.checkpoint=/x", "task.reasoning_gym.config.max_terms=3"])
    rg = cfg.task.reasoning_gym
    assert cfg.task.source == "reasoning_gym" and rg.config["max_terms"] == 3
    assert rg.config["min_terms"] == load_config(EXAMPLE).task.reasoning_gym.config["min_terms"]  # the rest kept
    assert cfg.trainer.prompts_per_step == 16 and cfg.rollout.n == 8 and cfg.rollout.max_tokens == 256


def test_verl_parquet_round_trip(tmp_path, capsys):
    out = tmp_path / "train.parquet"
    assert cli.main(["data", "--config", EXAMPLE, "task.reasoning_gym.size=7", "--out", str(out)]) == 0
    assert "wrote 7 rows" in capsys.readouterr().out
    back = load_parquet_dataset(out, answer_key="reward_model.ground_truth")
    made = rgt.make_problems(load_config(EXAMPLE, ["task.reasoning_gym.size=7"]).task.reasoning_gym)
    assert [dataclasses.replace(p, solution="") for p in made] == back
    # the scorer a verl user names (custom_reward_function pkg://rl_integration.reasoning_gym_task) reads them
    verl_task = TaskSection(source="parquet",
                            custom_reward_function=CustomRewardFunction("pkg://rl_integration.reasoning_gym_task"))
    reward = resolve_reward(verl_task)
    assert score(reward, f"<answer>{back[3].answer}</answer>", back[3]) == 1.0 + back[3].extra_info["format_reward"]


def test_spectail_data_refuses_another_task_source(tmp_path, capsys):
    out = tmp_path / "x.parquet"
    assert cli.main(["data", "--config", EXAMPLE, "task.source=embedded", "--out", str(out)]) == 2
    assert "'task.source' must be 'reasoning_gym'" in capsys.readouterr().err and not out.exists()


def test_the_example_trains_end_to_end_on_the_tiny_policy(tiny_run, tmp_path, capsys):
    """examples/grpo_real.yaml through `spectail train`, the tiny policy in SmolLM2's place: chat
    prompts through a chat template, the data set's scorer on every sample."""
    out = tmp_path / "run"
    rc = cli.main(["train", "--config", EXAMPLE, *tiny_run, "policy.source=embedded",
                   f"policy.chat_template={json.dumps(TEMPLATE)}", "task.reasoning_gym.size=8",
                   "task.reasoning_gym.system_prompt=''", "rollout.engine.max_model_len=128", "rollout.n=2",
                   "trainer.steps=1", "trainer.prompts_per_step=8", "output.plot=false", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert record["num_samples"] == 16 and 0.0 <= record["reward_mean"] <= 1.1
