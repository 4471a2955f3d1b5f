"""The embedded RL task: add two numbers by counting on, one unit per line, like an odometer.

    prompt:    "038+04\n"
    solution:  "039+03\n040+02\n041+01\n042+00\nanswer 042"     (the policy then emits </s>)
    answer:    "42"

Each line moves one unit from the count on the right to the running total on the left, until
the count is 0; then the answer line. Numbers are zero-padded to a fixed width (3 digits for the
total, 2 for the count with the defaults), so every line has the same length and each digit sits
exactly one line below the digit it comes from: a tiny transformer learns the chain in a minute
of CPU, where variable-width numbers took several times longer and sometimes not at all.

The count is heavy-tailed (P(count) ~ count^-tail_alpha on [min_count, max_count]), so most
responses are short and a few are very long: with the defaults the 99th percentile of the
response length in tokens is about 15x the median (measured over 2000 problems, see the tests).
That is the long tail spectail is about.

Every running total is a chance for an arithmetic slip (see `format_solution`): the warm-started
policy sampled at T=1 is right on some prompts and not on others — the longer the chain the
likelier a slip — and RL has something to improve. The worked solution is a pure function of
the prompt, so a policy that has learnt it answers the same prompt with (nearly) the same text
every epoch, which history reuse drafts from.

The reward is verifiable: 1.0 when the first `answer <int>` in the response equals the ground
truth (leading zeros ignored), else 0.0 — never an exception, whatever the response holds.

API:
    TaskConfig                  the generator's knobs (dataclass)
    Problem(prompt, answer, solution)
    make_problems(cfg) -> list[Problem]          deterministic given cfg (seed included)
    parse_prompt(prompt) -> (start, count, widths);  format_solution(prompt, slip_rate=0, rng=None)
    extract_answer(text) -> str | None
    reward_fn(response, answer, tokenizer=None) -> float
    load_parquet_dataset(path, prompt_key="prompt", answer_key="answer") -> list[Problem]
    save_parquet_dataset(problems, path)
"""
from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from scheduler.atomic_file import atomic_path


@dataclass(frozen=True)
class TaskConfig:
    """Knobs of the problem generator.

    num_problems: how many problems make_problems returns.
    seed: the generator's seed; the same config always gives the same problems.
    min_start, max_start: the left addend (the running total's start) is uniform in [min_start, max_start].
    min_count, max_count: the range of the right addend (the count), one response line per unit.
    tail_alpha: P(count) is proportional to count ** -tail_alpha; smaller means a heavier tail.
    """

    num_problems: int = 256
    seed: int = 0
    min_start: int = 0
    max_start: int = 99
    min_count: int = 1
    max_count: int = 64
    tail_alpha: float = 1.3

    def validate(self) -> None:
        if self.num_problems < 0:
            raise ValueError(f"TaskConfig.num_problems must be >= 0, got {self.num_problems}")
        if not (0 <= self.min_start <= self.max_start):
            raise ValueError(
                f"TaskConfig needs 0 <= min_start <= max_start, got {self.min_start}, {self.max_start}"
            )
        if not (1 <= self.min_count <= self.max_count):
            raise ValueError(
                f"TaskConfig needs 1 <= min_count <= max_count, got {self.min_count}, {self.max_count}"
            )
        if not (self.tail_alpha >= 0.0):  # also rejects NaN
            raise ValueError(f"TaskConfig.tail_alpha must be >= 0, got {self.tail_alpha}")


@dataclass(frozen=True)
class Problem:
    """One prompt, its ground-truth answer, and a worked solution (the response text without </s>).
    `solution` is "" for problems loaded from a data set that has none."""

    prompt: str
    answer: str
    solution: str = ""


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
    given, else with the embedded task's fixed vocabulary (rl_integration.tokenizer)."""
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


def save_parquet_dataset(problems: Sequence[Problem], path: Union[str, os.PathLike]) -> None:
    """Write problems as a Parquet table (columns prompt, answer, solution), atomically:
    into a temporary file beside `path`, then renamed over it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "prompt": [p.prompt for p in problems],
            "answer": [p.answer for p in problems],
            "solution": [p.solution for p in problems],
        }
    )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def load_parquet_dataset(
    path: Union[str, os.PathLike], prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[Problem]:
    """Read problems from a Parquet file. A `solution` column is used when present.
    Raises ValueError naming the missing column(s) and the columns the file has."""
    import pyarrow.parquet as pq

    table = pq.read_table(os.fspath(path))
    present = table.column_names
    missing = [k for k in (prompt_key, answer_key) if k not in present]
    if missing:
        raise ValueError(
            f"{os.fspath(path)}: missing column(s) {missing}; the file has columns {present} "
            f"(choose others with prompt_key= / answer_key=)"
        )
    prompts = table.column(prompt_key).to_pylist()
    answers = table.column(answer_key).to_pylist()
    solutions = table.column("solution").to_pylist() if "solution" in present else [""] * len(prompts)
    return [
        Problem(str(p), str(a), "" if s is None else str(s)) for p, a, s in zip(prompts, answers, solutions)
    ]
