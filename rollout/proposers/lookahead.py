"""Lookahead: the target's own samples past a rejected draft token draft the next step.

A verify step samples every draft position. Past the first mismatch those samples are
conditioned on the wrong token, so the engine emits none of them, but they are good guesses:
what a model writes a few tokens on rarely hangs on one earlier token (a digit, a word choice).
So the engine keeps them on the request (`Request.lookahead`, with their probabilities), and this
proposer offers them, after the corrected token, as the next draft. When a request's text has
drifted from everything the group wrote (an early slip shifts every later line), history and
siblings have nothing to copy, and this is what still drafts. Like every draft, these are
verified against the exact sample: a wrong guess costs a forward slot, never a token.
"""
from __future__ import annotations

from typing import Optional

from ..request import Request
from .base import Draft, Proposer


class LookaheadProposer(Proposer):
    name = "lookahead"
    wants_lookahead = True

    @classmethod
    def from_config(cls, spec, model=None, engine_config=None) -> LookaheadProposer:
        return cls()

    def propose(self, req: Request, k: int) -> Optional[Draft]:
        la = req.lookahead
        if k <= 0 or la is None or la.position != len(req.output_ids):
            return None  # none left from the last step, or stale (the output moved on)
        # no agreement to report: the budget learns per position (evidence 0 + i) and confidence
        return Draft(la.tokens[:k], self, evidence=0, confidence=la.probs[:k])

    def finish(self, req: Request) -> None:
        req.lookahead = None
