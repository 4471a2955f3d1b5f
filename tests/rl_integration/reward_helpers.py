"""Reward functions named by tests as `tests.rl_integration.reward_helpers:NAME`."""
from __future__ import annotations

from rl_integration.demo.task import reward_fn

SEEN: list[tuple[str, str]] = []  # (response text, answer) pairs seen by `recording`


def recording(text: str, answer: str) -> float:
    SEEN.append((text, answer))
    return reward_fn(text, answer)


def raising(text: str, answer: str) -> float:
    raise KeyError("no such field")


def not_a_number(text: str, answer: str):
    return "1.0"


CALLS = {"first_call_only": 0}


def first_call_only(text: str, answer: str):
    """A number for the probe before the first rollout, then a string: fails during the run."""
    CALLS["first_call_only"] += 1
    return 0.0 if CALLS["first_call_only"] == 1 else "1.0"


VERL_SEEN: list[dict] = []  # the keyword arguments of each call of `compute_score`


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention: keywords in, a dict with "score" out."""
    VERL_SEEN.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                      "extra_info": dict(extra_info)})
    extra_info["touched"] = True  # a scorer may change its copy; the next sample's is fresh
    return {"score": reward_fn(solution_str, ground_truth), "answered": 1.0}


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5
