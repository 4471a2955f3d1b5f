"""The state of one request inside the engine, and the read-only view proposers get."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .config import SamplingParams


@dataclass
class Lookahead:
    """The target's samples past the last rejected draft token (see proposers/lookahead.py)."""

    position: int  # the response position of tokens[0]
    tokens: list[int]
    probs: list[float]  # the probability of each where it was sampled


@dataclass
class Request:
    """A prompt being completed. Tokens in `prompt_ids + output_ids` at positions below
    `num_cached` are in this request's KV-cache slot; the rest are `pending` (fed next step).
    Rolling back a rejected draft is only lowering `num_cached`."""

    index: int  # position in the caller's list
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    history: Optional[list[int]] = None  # a previous response, drafted from by "history"
    history_logprobs: Optional[list[float]] = None  # its logprobs: drafts' confidence, and lenience
    group: Optional[int] = None  # requests sharing a prompt in one GRPO group
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
    lookahead: Optional[Lookahead] = None  # set by the engine after a draft was rejected

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
