"""Data sets on disk: one Parquet row per prompt, in the plain layout or in verl's.

    problems = load_parquet_dataset("train.parquet")                        # prompt, answer
    problems = load_parquet_dataset("gsm8k.parquet", answer_key="reward_model.ground_truth")   # verl's
    ids = encode_prompts(tokenizer, problems)                               # chat prompts templated

Plain: `prompt` (text), `answer`, optionally `solution`. verl's (verl/utils/dataset/rl_dataset.py):
`prompt` is a list of chat messages, `data_source` names the scorer, the answer is a field of a
struct (a dotted key), `extra_info` a struct handed to the scorer. A chat prompt is rendered
through the chat template with add_generation_prompt=True, as verl's agent loop does. Numeric
answers become text; other values are kept for a custom scorer. Every row is checked on reading:
a ValueError names the row and the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from scheduler.atomic_file import atomic_path


@dataclass(frozen=True)
class Problem:
    """One prompt (text, or chat messages: a list of {"role", "content", ...} dicts), its
    ground-truth answer, and a worked solution (the response text without </s>; "" when the data
    set has none). data_source and extra_info go to a verl-style scorer (rl_integration/rewards.py)."""

    prompt: Union[str, list]
    answer: Any
    solution: str = ""
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)


def save_parquet_dataset(problems: Sequence[Problem], path: Union[str, os.PathLike]) -> None:
    """Write text-prompt problems as a Parquet table (columns prompt, answer, solution), atomically."""
    write_rows([{"prompt": p.prompt, "answer": p.answer, "solution": p.solution} for p in problems], path)


def write_rows(rows: Sequence[dict], path: Union[str, os.PathLike]) -> None:
    """Rows (dicts of column -> value; nested dicts become structs, lists lists) as a Parquet
    file, atomically: into a temporary file beside `path`, then renamed over it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(list(rows))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def load_parquet_dataset(path: Union[str, os.PathLike], prompt_key: str = "prompt", answer_key: str = "answer",
                         data_source_key: str = "data_source", extra_info_key: str = "extra_info") -> list[Problem]:
    """Read problems from a Parquet file. `solution`, `data_source_key` and `extra_info_key` are
    used when the file has them. Raises ValueError naming a missing column (and the columns the
    file has), or the row and key of a value that cannot be a problem's."""
    import pyarrow.parquet as pq

    where = os.fspath(path)
    try:
        table = pq.read_table(where)
    except Exception as e:  # not Parquet, damaged, a folder of other files, ...
        raise ValueError(f"{where}: cannot be read as Parquet: {type(e).__name__}: {e}") from None
    missing = [k for k in (prompt_key, answer_key) if not _has(table, k)]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; the file has columns {table.column_names} "
                         "(choose others with task.parquet.prompt_key / answer_key)")
    prompts = column_values(table, prompt_key, where)
    answers = column_values(table, answer_key, where)
    optional = {key: column_values(table, key, where) if _has(table, key) else [None] * table.num_rows
                for key in ("solution", data_source_key, extra_info_key)}
    return [_problem(i, where, prompt_key, answer_key, extra_info_key, p, a, optional["solution"][i],
                     optional[data_source_key][i], optional[extra_info_key][i])
            for i, (p, a) in enumerate(zip(prompts, answers))]


def column_values(table, key: str, where: str = "the data set") -> list:
    """The values of column `key`, or of a field of a struct column for a dotted key
    ('reward_model.ground_truth'); a column literally named `key` comes first."""
    import pyarrow as pa

    if key in table.column_names:
        return table.column(key).to_pylist()
    head, *fields = key.split(".")
    if head not in table.column_names:
        raise ValueError(f"{where}: missing column {head!r} (for key {key!r}); the file has columns "
                         f"{table.column_names} (choose others with task.parquet.prompt_key / answer_key)")
    tp, path = table.schema.field(head).type, head
    for name in fields:
        if not pa.types.is_struct(tp) or tp.get_field_index(name) < 0:
            known = [tp.field(i).name for i in range(tp.num_fields)] if pa.types.is_struct(tp) else []
            raise ValueError(f"{where}: column {path!r} has no field {name!r} (for key {key!r}); "
                             + (f"its fields are {known}" if known else f"it holds {tp}, not a struct"))
        tp, path = tp.field(name).type, f"{path}.{name}"
    values = table.column(head).to_pylist()
    for name in fields:  # a null struct has null fields
        values = [None if v is None else v.get(name) for v in values]
    return values


def _has(table, key: str) -> bool:
    return key in table.column_names or key.split(".")[0] in table.column_names


def _problem(i: int, where: str, prompt_key: str, answer_key: str, extra_key: str, prompt, answer, solution,
             data_source, extra) -> Problem:
    here = f"{where}: row {i}"
    if answer is None:
        raise ValueError(f"{here}: the answer ({answer_key!r}) is null")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{here}: {extra_key!r} must be a struct (a mapping), got {type(extra).__name__}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    return Problem(prompt=check_prompt(prompt, f"{here}: {prompt_key!r}"), answer=answer,
                   solution="" if solution is None else str(solution),
                   data_source="" if data_source is None else str(data_source), extra_info=dict(extra or {}))


def check_prompt(prompt, where: str) -> Union[str, list]:
    """The prompt as text or as a list of message dicts (null fields dropped), else ValueError."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(_is_message(m) for m in prompt):
        return [{k: v for k, v in m.items() if v is not None} for m in prompt]
    shown = repr(prompt)
    raise ValueError(f"{where} must be a string or a non-empty list of chat messages ({{'role': str, 'content': "
                     f"str}}), got {type(prompt).__name__} {shown[:80] + ('...' if len(shown) > 80 else '')}")


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def encode_prompts(tokenizer, problems: Sequence[Problem], chat_template: Optional[str] = None) -> list[list[int]]:
    """Token ids of each problem's prompt: text through the tokenizer, chat messages through its
    chat template with add_generation_prompt=True (`chat_template` replaces the tokenizer's)."""
    chats = [i for i, p in enumerate(problems) if not isinstance(p.prompt, str)]
    if chats and chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"problem {chats[0]}'s prompt is a list of chat messages but the tokenizer has no chat "
                         "template: use a checkpoint whose tokenizer has one, or set policy.chat_template")
    out = []
    for i, p in enumerate(problems):
        if isinstance(p.prompt, str):
            out.append([int(t) for t in tokenizer(p.prompt)["input_ids"]])
            continue
        try:
            ids = tokenizer.apply_chat_template(p.prompt, add_generation_prompt=True, tokenize=True,
                                                chat_template=chat_template)
        except Exception as e:  # a template error (jinja), a role the template refuses, ...
            raise ValueError(f"problem {i}'s chat prompt cannot be rendered by the chat template: "
                             f"{type(e).__name__}: {e}") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        out.append([int(t) for t in ids])
    return out
