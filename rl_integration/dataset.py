"""Data sets on disk: one Parquet row per prompt, with its ground-truth answer.

    problems = load_parquet_dataset("train.parquet", prompt_key="prompt", answer_key="answer")
    save_parquet_dataset(problems, "train.parquet")
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, Union

from scheduler.atomic_file import atomic_path


@dataclass(frozen=True)
class Problem:
    """One prompt, its ground-truth answer, and a worked solution (the response text without </s>).
    `solution` is "" for problems loaded from a data set that has none."""

    prompt: str
    answer: str
    solution: str = ""



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
