"""History reuse (SPEC-RL): last epoch's response to the same (prompt, sample index) drafts
this epoch's.

With a per-sample seed the old response was drawn with the same Gumbel noise, so wherever the
policy barely moved the new tokens equal the old ones. Per request the proposer keeps a pointer
into the old response aligned with the end of the output, and drafts the next k old tokens.
On a mismatch it re-aligns:

1. on the longest of the output's last max_match..min_match tokens found in the old response
   (ties: the nearest at or after the pointer, else before it);
2. else on a guessed deletion or substitution at the pointer (a second miss drops the guess);
3. else, with no guess left, on the last token alone within max_match of where alignment was lost;
4. else it offers nothing until a later suffix matches.

While aligned a step costs O(emitted + k); the old response's bigram index is built on the first
mismatch only.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional

from ..core.request import Request
from .base import Draft, Proposer, StepResult


@dataclass
class _State:
    hist: list[int]
    pos: int = 0  # output tokens consumed so far
    ptr: int = 0  # next position in hist that the output should continue with
    aligned: bool = True
    last: int = -1  # out[pos - 1]
    tentative: bool = False  # ptr is a substitution guess, not yet confirmed by a match
    run: int = 0  # output tokens that agree with hist up to ptr (the evidence for the next draft)
    index: Optional[dict] = None  # (a, b) -> positions right after each bigram, ascending
    probs: Optional[list[float]] = None  # exp(the old logprobs), made on first use


class HistoryProposer(Proposer):
    """Drafts from `req.history`, re-aligning after insertions, deletions and substitutions.

    max_match / min_match (>= 2): the longest and shortest output suffix looked up when re-aligning.
    max_candidates: bigram occurrences examined per re-alignment (bounds repetitive responses).
    """

    name = "history"
    prior = 0.9  # the old response is usually right where the policy barely moved
    max_match, min_match, max_candidates = 8, 2, 64

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        return [self._draft(req, k) for req in requests]

    def _draft(self, req: Request, k: int) -> Optional[Draft]:
        """The next k old tokens while aligned. evidence: tokens of agreement behind the alignment
        (the prompt too while followed from the start); confidence: the old policy's probabilities."""
        if k <= 0 or not req.history:
            return None
        st = self._sync(req)
        if not st.aligned or st.ptr >= len(st.hist):
            return None
        tokens = st.hist[st.ptr : st.ptr + k]
        return Draft(tokens, self, evidence=st.run, confidence=self._confidence(req, st, len(tokens)))

    def _confidence(self, req: Request, st: _State, n: int) -> Optional[list[float]]:
        lps = req.history_logprobs
        if lps is None or len(lps) != len(st.hist):
            return None
        if st.probs is None:
            st.probs = [math.exp(lp) for lp in lps]
        return st.probs[st.ptr : st.ptr + n]

    def on_step(self, result: StepResult) -> tuple:
        """Catches up only in steps the budget let it draft: switched off, it costs nothing per token."""
        if self in result.drafting:
            for row in result.rows:
                if row.req.history:
                    self._sync(row.req)
        for req in result.left:
            req.proposer_state.pop(self.name, None)
        return ()

    def _sync(self, req: Request) -> _State:
        """Bring the state up to date with req.output_ids (only the new tokens are read)."""
        st = req.proposer_state.get(self.name)
        out = req.output_ids
        if (st is None or st.hist is not req.history or st.pos > len(out)
                or (st.pos and out[st.pos - 1] != st.last)):  # O(1) check that out only grew
            st = req.proposer_state[self.name] = _State(hist=req.history, run=len(req.prompt_ids))
        if st.pos == len(out):
            return st
        hist, n_hist = st.hist, len(st.hist)
        missed = False
        anchor = st.ptr
        for i in range(st.pos, len(out)):
            if not st.aligned:
                continue  # nothing per token; re-aligned from the suffix below
            if st.ptr < n_hist and hist[st.ptr] == out[i]:
                st.ptr += 1
                st.run += 1
                st.tentative = False
                continue
            missed = True
            st.run = 0
            anchor = st.ptr
            if not st.tentative and st.ptr + 1 < n_hist and hist[st.ptr + 1] == out[i]:
                st.ptr += 2  # guess: hist[ptr] was deleted
                st.tentative = True
            elif not st.tentative and st.ptr < n_hist:
                st.ptr += 1  # guess: out[i] replaced hist[ptr]
                st.tentative = True
            else:
                st.aligned = False
                st.tentative = False
        st.pos = len(out)
        st.last = out[-1]
        if missed or not st.aligned:
            anchor = anchor if missed else st.ptr
            found = self._realign(st, out, anchor)
            if found is None and not st.aligned:
                found = _near(hist, out[-1], anchor, self.max_match)
            if found is not None:
                (st.ptr, st.run), st.aligned, st.tentative = found, True, False
        return st

    def _realign(self, st: _State, out: list[int], anchor: int) -> Optional[tuple[int, int]]:
        """(position after the longest match of out's suffix with a continuation, its length), or None."""
        if len(out) < self.min_match:
            return None
        if st.index is None:
            st.index = _bigram_index(st.hist)
        cands = st.index.get((out[-2], out[-1]))
        if not cands:
            return None
        hist, n_hist = st.hist, len(st.hist)
        limit = min(self.max_match, len(out))
        best_len, best_pos = 0, None
        for p in _nearest_first(cands, anchor, self.max_candidates):
            if p >= n_hist:
                continue  # no continuation to draft
            n = 2  # hist[p-2:p] == out[-2:] by the index
            while n < limit and p - n - 1 >= 0 and hist[p - n - 1] == out[-n - 1]:
                n += 1
            if n > best_len:
                best_len, best_pos = n, p
                if n >= limit:
                    break
        if best_len < self.min_match:
            return None
        return best_pos, best_len


def _near(hist: list[int], tok: int, anchor: int, window: int) -> Optional[tuple[int, int]]:
    """(position after the occurrence of tok nearest to `anchor` within `window` that has a continuation, 1)."""
    n = len(hist)
    for d in range(window + 1):
        for i in (anchor + d, anchor - d - 1):
            if 0 <= i < n - 1 and hist[i] == tok:
                return i + 1, 1
    return None


def _bigram_index(hist: list[int]) -> dict:
    index: dict = {}
    for i in range(2, len(hist) + 1):
        index.setdefault((hist[i - 2], hist[i - 1]), []).append(i)
    return index


def _nearest_first(positions: list[int], anchor: int, limit: int) -> list[int]:
    """At most `limit` ascending positions: those >= anchor nearest first, then those below it."""
    j = bisect.bisect_left(positions, anchor)
    return (positions[j:j + limit] + positions[max(0, j - limit):j][::-1])[:limit]
