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
