"""`task.source: reasoning_gym`: problems and reward from the public reasoning-gym package.

    problems = make_problems(cfg.task.reasoning_gym)
    score = compute_score(data_source=..., solution_str=text, ground_truth=answer, extra_info=...)
    write_verl_parquet(problems, "train.parquet")  # verl's layout, the same rows

reasoning-gym generates each item from (seed, index) alone, so a Problem stays plain data: its
extra_info names the data set, config, seed, size and index, and the scorer rebuilds the item
(cached) to call the data set's own `score_answer`. The answer is reasoning_gym's extraction
(the last <answer>...</answer>), or with answer_extraction "flexible" the last number; a
well-formed single answer pair earns extra_info's format_reward. compute_score has verl's
signature: point custom_reward_function at pkg://rl_integration.reasoning_gym_task.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from typing import Any, Optional, Sequence

from .dataset import Problem, write_rows

KEY = "task.reasoning_gym"
_OPEN, _CLOSE = "<answer>", "</answer>"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# keywords the section sets itself: the data set's config class has them too
_OWN_KEYS = {"seed": f"{KEY}.seed", "size": f"{KEY}.size"}


def _registry() -> dict:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ValueError(f"task.source 'reasoning_gym' needs the reasoning-gym package (pip install reasoning-gym): "
                         f"{e}") from None
    return DATASETS


def config_fields(name: str) -> list[str]:
    """The keywords data set `name`'s config class accepts (seed and size excluded: the section's own)."""
    _, config_cls = _registry()[name]
    return sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_KEYS)


def validate_source(rg) -> None:
    """ValueError naming the dotted key of the first thing wrong in a ReasoningGymSource."""
    datasets = _registry()
    if rg.name not in datasets:
        close = difflib.get_close_matches(rg.name, list(datasets), n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"config key '{KEY}.name': no reasoning_gym data set {rg.name!r}{hint}; "
                         f"reasoning_gym.factory.DATASETS has {len(datasets)}, e.g. {sorted(datasets)[:8]}")
    if not isinstance(rg.size, int) or rg.size < 1:
        raise ValueError(f"config key '{KEY}.size' must be >= 1 (problems to generate), got {rg.size!r}")
    if not 0 <= rg.seed < 2**63:
        raise ValueError(f"config key '{KEY}.seed' must be in [0, 2**63), got {rg.seed!r}")
    if not (math.isfinite(rg.format_reward) and rg.format_reward >= 0):
        raise ValueError(f"config key '{KEY}.format_reward' must be a finite number >= 0 (0: off), "
                         f"got {rg.format_reward!r}")
    _check_config(rg.name, rg.config)
    try:
        _dataset(rg.name, config_json(rg.config), rg.seed, rg.size)
    except Exception as e:  # the data set's own checks are asserts, TypeErrors, ...
        raise ValueError(f"config key '{KEY}.config': reasoning_gym refuses {rg.config!r} for data set "
                         f"{rg.name!r}: {type(e).__name__}: {e}") from None


def _check_config(name: str, config: dict) -> None:
    accepted = config_fields(name)
    for key in config:
        if key in _OWN_KEYS:
            raise ValueError(f"config key '{KEY}.config.{key}': set {_OWN_KEYS[key]} instead")
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"config key '{KEY}.config.{key}': data set {name!r} has no such option{hint}; its "
                             f"config class accepts {accepted}")
    try:
        config_json(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config key '{KEY}.config' must hold plain YAML values: {e}") from None


def config_json(config: dict) -> str:
    """The data set's keywords as canonical JSON text (a Parquet-friendly, hashable form)."""
    return json.dumps(config, sort_keys=True, allow_nan=False)


@functools.lru_cache(maxsize=16)
def _dataset(name: str, config_text: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_text))


def make_problems(rg) -> list[Problem]:
    """The section's problems, in index order: chat prompts, the data set's answers, and what the
    scorer needs to rebuild each item. The same section always gives the same problems."""
    validate_source(rg)
    text = config_json(rg.config)
    dataset = _dataset(rg.name, text, rg.seed, rg.size)
    system = [{"role": "system", "content": rg.system_prompt}] if rg.system_prompt else []
    out = []
    for i in range(rg.size):
        entry = dataset[i]
        answer = str(entry["answer"])
        extra = {"name": rg.name, "config": text, "seed": rg.seed, "size": rg.size, "index": i,
                 "format_reward": float(rg.format_reward), "answer_extraction": rg.answer_extraction}
        out.append(Problem(prompt=system + [{"role": "user", "content": str(entry["question"])}], answer=answer,
                           solution=f"{_OPEN}{answer}{_CLOSE}", data_source=f"reasoning_gym/{rg.name}",
                           extra_info=extra))
    return out


def well_formed(text: str) -> bool:
    """Exactly one <answer> and one </answer>, in that order, with something inside."""
    if text.count(_OPEN) != 1 or text.count(_CLOSE) != 1:
        return False
    inside = text.partition(_OPEN)[2].partition(_CLOSE)
    return bool(inside[1]) and bool(inside[0].strip())


def extract(text: str, how: str = "strict") -> Optional[str]:
    """The answer a response gives: its last <answer>...</answer> (reasoning_gym's own extraction);
    "flexible": else its last number (None when neither)."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    if answer is None and how == "flexible":
        numbers = _NUMBER.findall(text)
        answer = numbers[-1] if numbers else None
    return answer


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """verl's signature: the data set's own score_answer of the extracted answer, plus
    extra_info["format_reward"] for a well-formed answer. Raises when the item cannot be rebuilt
    or the data set's scorer raises (rl_integration/rewards.py turns that into a RewardError)."""
    missing = [k for k in ("name", "config", "seed", "size", "index") if k not in extra_info]
    if missing:
        raise ValueError(f"extra_info lacks {missing} (rows written by rl_integration.reasoning_gym_task carry them)")
    dataset = _dataset(extra_info["name"], extra_info["config"], int(extra_info["seed"]), int(extra_info["size"]))
    entry = dataset[int(extra_info["index"])]
    if str(entry["answer"]) != str(ground_truth):
        raise ValueError(f"{data_source} item {extra_info['index']} rebuilt with answer {entry['answer']!r}, but the "
                         f"row's ground truth is {ground_truth!r}: written by another reasoning-gym version?")
    how = extra_info.get("answer_extraction") or "strict"
    if how not in ("strict", "flexible"):
        raise ValueError(f"extra_info's answer_extraction must be 'strict' or 'flexible', got {how!r}")
    score = float(dataset.score_answer(extract(solution_str, how), entry))
    if well_formed(solution_str):
        score += float(extra_info.get("format_reward", 0.0))
    return score


def verl_rows(problems: Sequence[Problem], ability: str = "reasoning") -> list[dict]:
    """Rows in verl's layout (its examples/data_preprocess scripts): data_source, prompt (chat
    messages), ability, reward_model {style, ground_truth}, extra_info."""
    return [{"data_source": p.data_source, "prompt": list(p.prompt), "ability": ability,
             "reward_model": {"style": "rule", "ground_truth": p.answer}, "extra_info": dict(p.extra_info)}
            for p in problems]


def write_verl_parquet(problems: Sequence[Problem], path) -> None:
    """The problems as a verl Parquet file (atomically); read back with
    load_parquet_dataset(path, answer_key="reward_model.ground_truth")."""
    write_rows(verl_rows(problems), path)


