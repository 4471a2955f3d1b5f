"""What a draft source is (vLLM v1's contract): a guesser that returns drafts as values and hears
what each step did. Every token is verified, so a proposer can be wrong but never unsafe."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

from ..core.request import Request


@dataclass(frozen=True)
class Draft:
    """Tokens offered to follow a request's output. evidence: tokens of context that agree with the
    source copied (0: none known); confidence: per token, the probability the policy gave it where it
    was sampled (< 0 or NaN: unknown), or None. The budget learns acceptance by both."""
    tokens: list[int]
    proposer: Proposer
    evidence: int = 0
    confidence: Optional[list[float]] = None

    def cut(self, n: int) -> Draft:
        conf = None if self.confidence is None else self.confidence[:n]
        return self if n >= len(self.tokens) else Draft(self.tokens[:n], self.proposer, self.evidence, conf)


class Verified(NamedTuple):  # samples, logprobs: the exact samples at the last fed token and each draft token
    req: Request
    draft: Optional[Draft]
    accepted: int
    emitted: list[int]
    samples: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class StepResult:
    """rows: the requests that emitted, in step order; drafting: the proposers the budget let draft;
    hidden [N, d]: the final hidden state of each fed token (None unless a proposer wants_hidden);
    spans: (req, start, row, count): hidden rows row .. row + count - 1 had a correct context, req's
    positions start ..; left: the requests that leave the engine now; dropped: GRPO groups the
    caller is done with (in a result of no step); shared: (req, donor, n): req took the donor's
    first n positions before the step (rollout/core/prompt_share.py)."""
    rows: Sequence[Verified] = ()
    drafting: frozenset = frozenset()
    hidden: Any = None
    spans: Sequence[tuple[Request, int, int, int]] = ()
    left: Sequence[Request] = ()
    dropped: frozenset = frozenset()
    shared: Sequence[tuple[Request, Request, int]] = ()


class Proposer:
    """name: the registry name and stats key; prior: the acceptance rate assumed before any draft
    was judged; position_cost(n): seconds of one draft position for n requests, measured once."""
    name, prior, wants_hidden = "base", 0.5, False

    @classmethod
    def from_config(cls, spec, model=None, engine_config=None) -> Proposer:
        return cls()

    def propose(self, requests: Sequence[Request], k: int) -> list[Optional[Draft]]:
        """Once per step: up to k tokens per request, or None. The first n tokens drafted for k are
        those drafted for n: the budget cuts each draft to what it grants."""
        return [None] * len(requests)

    def on_step(self, result: StepResult) -> Sequence[tuple[Draft, int, int]]:
        """Returns (draft, accepted, judged) of drafts judged against the emitted tokens without
        being fed (exact: no emitted token depends on a draft), for the budget to learn from."""
        return ()

    def position_cost(self, n: int) -> float:
        return 0.0

    def state_sizes(self) -> dict[str, int]:  # entries held outside requests: 0 when idle
        return {}
