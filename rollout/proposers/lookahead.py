"""Lookahead: the target's own samples past a rejected draft token draft the next step.

Past the first mismatch a verify step's samples are conditioned on the wrong token, so none is
emitted, but what a model writes a few tokens on rarely hangs on one earlier token: kept with
their probabilities, they draft after the corrected token. When a request's text has drifted
from everything its group wrote, this is what still drafts.

Samples no draft used are judged against what the request emitted in their place, as a draft
that was not fed (exact: no emitted token depends on a draft), so the budget learns from every
rejection. Samples whose tokens have all landed so far wait (`_judging`) to be judged further.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

from ..core.request import Request
from .base import Draft, Proposer, StepResult


class _Samples(NamedTuple):
    position: int  # the response position of tokens[0]
    tokens: list[int]
    probs: list[float]  # the probability of each where it was sampled


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self):
        self._kept: dict[int, _Samples] = {}  # id(request) -> its last step's samples past a rejection
        self._judging: dict[int, _Samples] = {}  # id(request) -> undrafted samples all landed so far

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        drafts = []
        for req in requests:
            la = self._kept.get(id(req))
            if k <= 0 or la is None or la.position != len(req.output_ids):
                drafts.append(None)  # none left from the last step, or stale (the output moved on)
            else:  # no agreement to report: the budget learns per position (evidence 0 + i) and confidence
                drafts.append(Draft(la.tokens[:k], self, evidence=0, confidence=la.probs[:k]))
        return drafts

    def on_step(self, result: StepResult) -> list[tuple[Draft, int, int]]:
        judged = []
        for req, draft, accepted, emitted, samples, logprobs in result.rows:
            key = id(req)
            kept, waiting = self._kept.pop(key, None), self._judging.pop(key, None)
            if kept is not None or waiting is not None:
                drafted = draft is not None and draft.proposer is self  # its verify judged it already
                for la in (waiting, None if drafted else kept):
                    if la is not None:
                        judged.extend(self._judge(req, la))
            if accepted + 1 < len(samples) and len(emitted) == accepted + 1 and not req.finish_reason:
                self._kept[key] = _Samples(len(req.output_ids), samples[accepted + 1:],
                                           [math.exp(lp) for lp in logprobs[accepted + 1:]])
        for req in result.left:
            self._kept.pop(id(req), None)
            self._judging.pop(id(req), None)
        return judged

    def _judge(self, req: Request, la: _Samples) -> list[tuple[Draft, int, int]]:
        known = min(len(req.output_ids) - la.position, len(la.tokens))
        out = req.output_ids[la.position:la.position + known]
        landed = next((i for i in range(known) if out[i] != la.tokens[i]), known)
        if landed == known < len(la.tokens) and not req.finish_reason:
            self._judging[id(req)] = la  # (a newer one replaces an older one still landing: rare)
        elif known > 0:
            return [(Draft(la.tokens, self, 0, la.probs), landed, known)]
        return []

    def state_sizes(self) -> dict[str, int]:
        return {"requests": len(self._kept) + len(self._judging)}
