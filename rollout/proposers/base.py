"""What a draft source is: a guesser that returns its draft as a value.

Drafts are only guesses: the engine verifies every token against the exact coupled sample, so
a proposer can be wrong but never unsafe. A proposer keeps per-request state, if any, on the
request (`req.proposer_state[self.name]`), so it lives and dies with the request, and per-group
state (GRPO siblings) until `drop_group`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..request import Request


@dataclass(frozen=True)
class Draft:
    """Tokens offered to follow a request's output, and what the budget judges them by.

    evidence: tokens of context that agree with the source the draft copies (0 = none known);
        the budget learns acceptance per evidence level (rollout/budget.py).
    confidence: per token, the probability the policy gave it where it was sampled (negative or
        NaN where unknown), or None; the budget learns acceptance per confidence bin too.
    """

    tokens: list[int]
    proposer: Proposer
    evidence: int = 0
    confidence: Optional[list[float]] = None

    def cut(self, n: int) -> Draft:
        """The first n tokens of this draft."""
        if n >= len(self.tokens):
            return self
        conf = None if self.confidence is None else self.confidence[:n]
        return Draft(self.tokens[:n], self.proposer, self.evidence, conf)  # (dataclasses.replace is slower)


@dataclass(frozen=True)
class HiddenSpan:
    """Rows of one request whose context was correct in a step: sequence positions start ..
    start + count - 1, at rows offset .. offset + count - 1 of the step's hidden states."""

    req: Request
    start: int
    offset: int
    count: int


class Proposer:
    """The base of every draft source: no draft, no state.

    name: the registry name (rollout/proposers/__init__.py) and the key of its stats.
    prior: the acceptance rate the budget assumes before it has seen any of its drafts.
    wants_lookahead: the engine keeps the target's samples past a rejected draft token on the
        request (`req.lookahead`) only when some proposer reads them.
    catches_up: `observe` only brings the proposer's state up to date with `req.output_ids`,
        which `propose` and `finish` do too; the engine then skips it in steps whose budget would
        not ask it, so a budget that has switched it off costs no bookkeeping per token.
    wants_hidden: the engine asks the forward for the final hidden state of every fed token and
        hands them over (`observe_hidden`); False costs nothing. May change between steps.
    batched: the proposer drafts for all requests at once (`prepare`), before any is asked;
        what a batched draft position costs (`position_cost`) is charged to its tokens when the
        budget decides how many positions are worth drafting.
    """

    name = "base"
    prior = 0.5
    wants_lookahead = False
    catches_up = False
    wants_hidden = False
    batched = False

    def prepare(self, requests: Sequence[Request], k: int) -> None:
        """Once per step, before any `propose` (batched proposers only): draft up to k positions
        for the requests that are decoding (one pending token); the budget found k worth it."""

    def position_cost(self, n: int) -> float:
        """Seconds one batched draft position costs for n requests (measured once by the proposer,
        never while a rollout runs: the budget must not depend on the machine's load)."""
        return 0.0

    def observe_hidden(self, spans: Sequence[HiddenSpan], hidden) -> None:
        """Once per step, after its verify: `hidden` [N, d] holds the final hidden state (after
        the last norm) of each token fed in the step; `spans` say which rows had a correct
        context (prompt chunks, the pending token, accepted drafts), per request."""

    def weights_updated(self, version: int) -> None:
        """The engine's weights were replaced (its version counter is now `version`)."""

    def slots_moved(self, src: Sequence[int], dst: Sequence[int], length: int) -> None:
        """The engine moved the requests of KV-cache slots src[i] to slots dst[i] (their first
        `length` positions; rollout/slot_order.py): state kept per slot must follow them."""

    def propose(self, req: Request, k: int) -> Optional[Draft]:
        """Up to k tokens that would follow req.prompt_ids + req.output_ids, or None.
        Deterministic given the request's state."""
        return None

    def observe(self, req: Request, draft: Optional[Draft], num_accepted: int, emitted: list[int]) -> None:
        """After each verify step of req: `draft` was offered (None: none of this proposer's),
        its first `num_accepted` tokens matched, and `emitted` were appended to the output."""

    def finish(self, req: Request) -> None:
        """req leaves this engine: finished, or paused at the end of a chunk of a divided
        rollout (it may come back, here or on another worker)."""
        req.proposer_state.pop(self.name, None)

    def drop_group(self, group) -> None:
        """The caller is done with this GRPO group: forget what is held for it."""

    def state_sizes(self) -> dict[str, int]:
        """Entries held outside any request (per group, say): all 0 once every group was dropped."""
        return {}

    def old_logprobs(self, req: Request, draft: Draft) -> Optional[list[float]]:
        """Per draft token, the logprob the old policy gave it at the same response position
        (NaN where unknown), for SPEC-RL's lenient acceptance (rollout/lenient.py); None when
        this proposer does not copy an earlier response of the request."""
        return None
