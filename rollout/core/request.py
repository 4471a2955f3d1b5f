"""A request: its state inside the engine, how it is made from a caller's input, its wire form
(what crosses to a Ray worker) and the Completion it ends as.

Input is checked before a Request exists (a ValueError naming the problem, no engine state
touched), from the vocabulary size and max_model_len alone: a Ray driver needs no model.
"""
from __future__ import annotations

import operator
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from ..config import Completion, SamplingParams
from .seeds import MAX_SEED

STAT_FIELDS = ("forward_passes", "proposed", "accepted", "lenient", "by_position")


@dataclass
class Request:
    """A prompt being completed. Tokens of `prompt_ids + output_ids` below `num_cached` are in its
    KV-cache slot, the rest are `pending`: rolling back a rejected draft lowers `num_cached`."""

    index: int  # position in the caller's list
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    history: Optional[list[int]] = None  # a previous response, drafted from by "history"
    history_logprobs: Optional[list[float]] = None  # its logprobs: drafts' confidence, and lenience
    group: Optional[object] = None  # requests sharing a prompt in one GRPO group (hashable)
    budget_end: Optional[int] = None  # pause (unfinished) once output reaches this length
    slot: int = -1
    num_cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    forward_passes: int = 0
    proposed: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)
    lenient: int = 0  # tokens accepted by the (biased) lenient mode
    # proposer -> [offered, accepted]: per draft position, drafts compared there and accepted to there
    by_position: dict = field(default_factory=dict)
    proposer_state: dict = field(default_factory=dict)  # proposer name -> its state for this request

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def pending(self) -> list[int]:
        """Tokens not yet in the cache: a prompt remainder, or the last sampled token."""
        p = len(self.prompt_ids)
        if self.num_cached >= p:
            return self.output_ids[self.num_cached - p:]
        return self.prompt_ids[self.num_cached:] + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def paused(self) -> bool:
        """Stopped at the end of its chunk of a divided rollout, to be continued elsewhere."""
        return self.finish_reason is None and self.budget_end is not None and len(self.output_ids) >= self.budget_end

    @property
    def chunk_left(self) -> int:
        return 1 << 62 if self.budget_end is None else self.budget_end - len(self.output_ids)

    def stats(self) -> dict:
        """The per-sample counters (STAT_FIELDS)."""
        return {"forward_passes": self.forward_passes, "proposed": dict(self.proposed),
                "accepted": dict(self.accepted), "lenient": self.lenient,
                "by_position": {k: [list(o), list(a)] for k, (o, a) in self.by_position.items()}}

    def count_positions(self, name: str, accepted: int, judged: int) -> None:
        """A verified draft of `name`: its first `judged` positions were offered, `accepted` landed."""
        offered, landed = self.by_position.setdefault(name, ([], []))
        for counts, n in ((offered, judged), (landed, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def set_stats(self, stats: dict) -> None:
        """Take counters from `stats()` of a copy of this request (they are cumulative)."""
        for name in STAT_FIELDS:
            if name in stats:
                value = stats[name]
                if name == "by_position":
                    value = {k: ([*o], [*a]) for k, (o, a) in value.items()}
                setattr(self, name, dict(value) if isinstance(value, dict) else value)

    def completion(self) -> Completion:
        return Completion(list(self.output_ids), list(self.logprobs), self.finish_reason or "length", self.seed,
                          self.stats())

    def to_wire(self) -> dict:
        """What another engine needs to continue this request with the same tokens."""
        return {"prompt_ids": self.prompt_ids, "output_ids": self.output_ids, "logprobs": self.logprobs,
                "seed": self.seed, "params": self.params, "history": self.history,
                "history_logprobs": self.history_logprobs, "group": self.group, "stats": self.stats()}

    @staticmethod
    def from_wire(wire: dict, vocab_size: int, max_model_len: int, index: int = 0) -> Request:
        """The request `to_wire` described, validated as a caller's input is."""
        out, lps = list(wire.get("output_ids") or ()), list(wire.get("logprobs") or ())
        if len(lps) != len(out):
            raise ValueError(f"request {index}: {len(lps)} logprobs for {len(out)} output tokens")
        (req,) = make_requests(vocab_size, max_model_len, [wire["prompt_ids"]], [wire["params"]], [wire["seed"]],
                               [wire.get("history")], [wire.get("group")], [out], [wire.get("history_logprobs")])
        req.index = index
        req.logprobs = [float(x) for x in lps]
        req.set_stats(wire.get("stats") or {})
        return req


def make_requests(vocab_size: int, max_model_len: int, prompt_token_ids, sampling_params=SamplingParams(),
                  seeds=None, drafts=None, groups=None, outputs=None, draft_logprobs=None) -> list[Request]:
    """As Engine.generate's arguments; outputs: tokens already generated (a divided rollout)."""
    prompt_token_ids = _sequence(prompt_token_ids, "prompt_token_ids")
    n = len(prompt_token_ids)
    params = _per_prompt_params(sampling_params, n)
    if seeds is None:
        seeds = [random.getrandbits(63) for _ in range(n)]
    given = {"seeds": seeds, "drafts": drafts, "groups": groups, "outputs": outputs, "draft_logprobs": draft_logprobs}
    rows = zip(*(_per_prompt(value, n, what) for what, value in given.items()))  # each checked before any request
    return [_make_request(i, prompt_token_ids[i], params[i], *row, vocab_size, max_model_len)
            for i, row in enumerate(rows)]


def _make_request(i, prompt, params, seed, draft, group, out, old_lps, vocab_size, max_model_len) -> Request:
    prompt = check_ids(prompt, vocab_size, f"prompt {i}")
    if not prompt:
        raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_model_len is "
                         f"{max_model_len} and at least one must be left to generate")
    params.validate(vocab_size)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seeds[{i}] must be an integer in [0, 2**63), got {seed!r}")
    draft = None if draft is None else check_ids(draft, vocab_size, f"drafts[{i}]")
    out = [] if out is None else check_ids(out, vocab_size, f"outputs[{i}]")
    old_lps = None if old_lps is None else _logprobs(old_lps, f"draft_logprobs[{i}]")
    if old_lps is not None and (draft is None or len(old_lps) != len(draft)):
        raise ValueError(f"draft_logprobs[{i}] must have one logprob per token of drafts[{i}]")
    try:
        hash(group)
    except TypeError:
        raise ValueError(f"groups[{i}] must be a hashable id (an int, say) or None, got {group!r}") from None
    return Request(index=i, prompt_ids=prompt, params=params, seed=seed, history=draft, history_logprobs=old_lps,
                   group=group, output_ids=out, logprobs=[float("nan")] * len(out))


def check_ids(ids: Iterable[int], vocab_size: int, what: str) -> list[int]:
    """Token ids as ints: Python, NumPy or 0-d tensor integers; never a float, string or bool."""
    try:
        if isinstance(ids, (str, bytes)):
            raise TypeError
        ids = [operator.index(t) for t in ids if not isinstance(t, bool) or _refuse()]
    except TypeError:
        raise ValueError(f"{what} must be a sequence of integer token ids") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return ids


def _refuse():
    raise TypeError


def _logprobs(values, what: str) -> list[float]:
    """Floats (NaN: unknown); never a string or None."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        return [float(x) for x in values if not isinstance(x, (str, bytes)) or _refuse()]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of numbers (NaN: unknown)") from None


def _sequence(value, what: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"{what} must be a sequence, got {type(value).__name__}")
    return list(value)


def _per_prompt_params(value, n: int) -> list:
    if isinstance(value, SamplingParams):
        return [value] * n
    value = _per_prompt(_sequence(value, "sampling_params"), n, "sampling_params")
    if not all(isinstance(v, SamplingParams) for v in value):
        raise ValueError("sampling_params must be a SamplingParams or a list of them")
    return value


def _per_prompt(value, n: int, what: str) -> list:
    if value is None:
        return [None] * n
    value = _sequence(value, what)
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
    return value
