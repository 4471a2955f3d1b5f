"""Reward functions for `spectail train`, in two calling conventions.

    reward = resolve_reward(cfg.task)          # the import is checked here, before anything runs
    check_reward(reward, problems[0])          # one probe call: a number, or ValueError
    rewards = compute_rewards(reward, tokenizer, batch, batch_problems)    # one float per sample

- `task.reward`: "embedded" (the demo's reward; for reasoning_gym the data set's own scorer) or
  "package.module:function", called as fn(response_text, answer).
- `task.custom_reward_function` {path, name}: verl's convention (verl/utils/import_utils.py, and
  its naive reward manager): a file or module, `name` called as compute_score(data_source=,
  solution_str=, ground_truth=, extra_info=) -> a number or a dict with "score" (awaited if a
  coroutine), each call with its own copy of extra_info.
A reward that raises or returns anything but a finite number (bools included) is an error
naming the function and the sample; the probe call makes a wrong return type stop the run
before any rollout.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from .dataset import Problem


class RewardError(RuntimeError):
    """The reward function raised or returned something that is not a finite number."""


@dataclass(frozen=True)
class Reward:
    name: str  # for messages: "embedded", "package.module:function", "rewards.py:compute_score"
    fn: Callable
    verl_style: bool  # called as compute_score(data_source=, solution_str=, ground_truth=, extra_info=)


def resolve_reward(task) -> Reward:
    """The reward a TaskSection names; ValueError when it cannot be loaded."""
    custom = task.custom_reward_function
    if custom.path:
        fn = load_scorer(custom.path, custom.name)
        return Reward(f"{custom.path}:{custom.name}", fn, True)
    if task.reward == "embedded" and task.source == "reasoning_gym":
        from .reasoning_gym_task import compute_score
        return Reward(f"reasoning_gym/{task.reasoning_gym.name}", compute_score, True)
    if task.reward == "embedded":
        from .demo.task import reward_fn
        return Reward("embedded", lambda text, answer: reward_fn(text, answer), False)
    module, _, name = task.reward.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task.reward {task.reward!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"task.reward {task.reward!r} is not callable")
    return Reward(task.reward, fn, False)


def load_scorer(path: str, name: str) -> Callable:
    """Object `name` of a Python file or module (verl's custom_reward_function path forms)."""
    key = f"task.custom_reward_function.path {path!r}"
    is_module = path.startswith("pkg://") or not (path.startswith("file://") or path.endswith(".py") or os.sep in path)
    try:
        if is_module:
            module = importlib.import_module(path.removeprefix("pkg://").replace("/", "."))
        else:
            module = _load_file(path.removeprefix("file://"), key)
    except ImportError as e:
        raise ValueError(f"{key} cannot be imported: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # the file's own code raised while loading
        raise ValueError(f"{key} raised {type(e).__name__} while loading: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{key} has no {name!r} (task.custom_reward_function.name)")
    if not callable(fn):
        raise ValueError(f"{key}: {name!r} is not callable")
    return fn


def _load_file(file: str, key: str):
    if not os.path.isfile(file):
        raise ValueError(f"{key} is not a file")
    digest = hashlib.blake2b(os.path.abspath(file).encode(), digest_size=8).hexdigest()
    spec = importlib.util.spec_from_file_location(f"spectail_reward_{digest}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{key} cannot be loaded as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def score(reward: Reward, text: str, problem: Problem) -> float:
    """The reward of one response; RewardError (without the sample: the caller names it)."""
    try:
        if reward.verl_style:
            r = reward.fn(data_source=problem.data_source, solution_str=text, ground_truth=problem.answer,
                          extra_info=dict(problem.extra_info))
            if inspect.isawaitable(r):
                r = asyncio.run(_awaited(r))
        else:
            r = reward.fn(text, problem.answer)
    except Exception as e:
        raise RewardError(f"reward function {reward.name!r} raised {type(e).__name__}: {e}") from e
    value = r.get("score") if isinstance(r, dict) else r
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = f"a dict without a numeric 'score' ({sorted(r)})" if isinstance(r, dict) else repr(r)
        raise RewardError(f"reward function {reward.name!r} returned {what} (need a finite number"
                          + (", or a dict with a numeric 'score')" if reward.verl_style else ")"))
    return float(value)


async def _awaited(awaitable):
    return await awaitable


def check_reward(reward: Reward, problem: Problem) -> None:
    """One probe call on the problem's worked solution ("" if none): a clear ValueError now
    rather than a failed run after the first rollout."""
    try:
        score(reward, problem.solution, problem)
    except RewardError as e:
        raise ValueError(f"{e}, when probed before the first rollout with the data set's first row "
                         f"(response {problem.solution!r})") from None


def compute_rewards(reward: Reward, tokenizer, batch, problems: Sequence[Problem]) -> list[float]:
    """One reward per sample of a RolloutBatch whose prompt g is `problems[g]`; RewardError
    naming the function, the sample and its prompt."""
    out = []
    for i, ids in enumerate(batch.completion_ids):
        problem = problems[batch.group_index[i]]
        try:
            out.append(score(reward, tokenizer.decode(ids, skip_special_tokens=True), problem))
        except RewardError as e:
            prompt = tokenizer.decode(batch.prompt_ids[i], skip_special_tokens=True)
            raise RewardError(f"{e} on sample {i} of step {batch.step} (prompt {prompt!r}, answer "
                              f"{problem.answer!r})") from e.__cause__
    return out
