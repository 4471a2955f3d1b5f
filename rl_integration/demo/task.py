"""The embedded RL task: add two numbers by counting on, one unit per line, like an odometer.

    prompt:    "038+04\n"
    solution:  "039+03\n040+02\n041+01\n042+00\nanswer 042"     (the policy then emits </s>)
    answer:    "42"

Numbers are zero-padded to a fixed width, so every line has the same length and each digit
sits exactly below the one it comes from: a tiny transformer learns the chain in a minute of
CPU. The count is heavy-tailed (P(count) ~ count^-tail_alpha), so most responses are short and
a few very long: the long tail spectail is about. The worked solution is a pure function of the
prompt, so a policy that learnt it answers a prompt with nearly the same text every epoch,
which history reuse drafts from. The reward is verifiable: 1.0 when the first `answer <int>`
equals the ground truth, else 0.0, never an exception.
"""
from __future__ import annotations

import random
import re
from typing import Optional, Sequence, Union

from ..config import TaskConfig
from ..dataset import Problem


def number_widths(cfg: TaskConfig) -> tuple[int, int]:
    """Digits of the running total and of the count: every number is zero-padded to these."""
    return len(str(cfg.max_start + cfg.max_count)), len(str(cfg.max_count))


def format_prompt(start: int, count: int, widths: tuple[int, int]) -> str:
    return f"{start:0{widths[0]}d}+{count:0{widths[1]}d}\n"


def parse_prompt(prompt: str) -> tuple[int, int, tuple[int, int]]:
    """(start, count, widths) of a prompt of this task, e.g. "038+04\n" -> (38, 4, (3, 2))."""
    left, right = prompt.strip().split("+")
    return int(left), int(right), (len(left), len(right))


def format_solution(prompt: str, slip_rate: float = 0.0, rng: Optional[random.Random] = None) -> str:
    """The worked solution of `prompt`. With `slip_rate` > 0 each line, with that probability,
    moves the running total by 0 or 2 instead of 1 (an arithmetic slip) and the rest of the chain
    carries the error on to a wrong answer: the supervised warm start learns from such noisy
    solutions, so the policy slips at about that rate when sampled at T=1 — which RL trains away."""
    total, count, (wt, wc) = parse_prompt(prompt)
    lines = []
    for k in range(1, count + 1):
        step = 1
        if slip_rate > 0.0 and rng is not None and rng.random() < slip_rate:
            step = rng.choice((0, 2))
        total += step
        lines.append(f"{total:0{wt}d}+{count - k:0{wc}d}")
    lines.append(f"answer {total:0{wt}d}")
    return "\n".join(lines)


def make_problem(start: int, count: int, widths: tuple[int, int]) -> Problem:
    prompt = format_prompt(start, count, widths)
    return Problem(prompt, str(start + count), format_solution(prompt))


def make_problems(cfg: TaskConfig) -> list[Problem]:
    """`cfg.num_problems` problems, a pure function of `cfg` (Python's `random`, stable across versions)."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    counts = list(range(cfg.min_count, cfg.max_count + 1))
    cum, acc = [], 0.0
    for n in counts:
        acc += n ** -cfg.tail_alpha
        cum.append(acc)
    widths, problems = number_widths(cfg), []
    for _ in range(cfg.num_problems):
        (count,) = rng.choices(counts, cum_weights=cum)
        problems.append(make_problem(rng.randint(cfg.min_start, cfg.max_start), count, widths))
    return problems


_ANSWER_RE = re.compile(r"answer[ \t]*(-?\d+)")


def extract_answer(text: str) -> Optional[str]:
    """The integer after the first `answer` in `text` (normalised, e.g. "007" -> "7"), or None."""
    if not isinstance(text, str):
        return None
    m = _ANSWER_RE.search(text)
    if m is None:
        return None
    return str(int(m.group(1)))


def reward_fn(response: Union[str, Sequence[int]], answer: Union[str, int], tokenizer=None) -> float:
    """1.0 if the response's first `answer <int>` equals `answer`, else 0.0; never raises.

    `response` is the response text, or its token ids: those are decoded with `tokenizer` when
    given, else with the embedded task's fixed vocabulary (rl_integration/demo/tokenizer.py)."""
    try:
        if not isinstance(response, str):
            if tokenizer is not None:
                response = tokenizer.decode(list(response), skip_special_tokens=True)
            else:
                from .tokenizer import decode_ids

                response = decode_ids(response)
        got = extract_answer(response)
        if got is None:
            return 0.0
        return 1.0 if int(got) == int(str(answer).strip()) else 0.0
    except Exception:
        return 0.0
