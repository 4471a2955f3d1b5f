"""History reuse (SPEC-RL): last epoch's response to the same (prompt, sample index) drafts
this epoch's.

With a per-sample seed the old response was drawn with the same Gumbel noise, so wherever the
policy barely moved the new tokens equal the old ones. The proposer keeps, per request, a
pointer into the old response that is aligned with the end of the current output and drafts
the next `k` old tokens from it. On a mismatch it re-aligns:

1. it looks for the current output's last `n` tokens (n = max_match down to min_match) in the
   old response — the longest match wins, and among equally long ones the closest occurrence
   at or after the old pointer (else the closest before it) — and drafts from right after it;
2. if nothing matches it guesses a deletion (the new token is the old one after the pointer)
   or else a substitution (the new token replaced the old one at the pointer) and drafts from
   just past it; a second miss in a row drops the guess;
3. otherwise, with no guess left, the last token alone re-aligns if it occurs within
   `max_match` positions of where the alignment was lost;
4. otherwise it offers nothing until a later suffix matches.

While aligned a step costs O(emitted + k). The n-gram index of the old response is built
lazily, on the first mismatch, so an unchanged response never pays for it. Drafts are only
guesses: the engine verifies every token, so a wrong alignment costs a forward, never a token.
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

    max_match / min_match: the longest and shortest output suffix looked up in the old response
        when re-aligning (min_match >= 2: a single shared token is trusted only within
        max_match positions of where the alignment was lost).
    max_candidates: occurrences of the last bigram examined per re-alignment, nearest to the
        old pointer first (bounds the cost on very repetitive responses).
    """

    name = "history"
    prior = 0.9  # the old response is usually right where the policy barely moved

    def __init__(self, max_match: int = 8, min_match: int = 2, max_candidates: int = 64):
        if min_match < 2:
            raise ValueError(f"HistoryProposer.min_match must be >= 2, got {min_match}")
        if max_match < min_match:
            raise ValueError(f"HistoryProposer.max_match must be >= min_match, got {max_match} < {min_match}")
        if max_candidates < 1:
            raise ValueError(f"HistoryProposer.max_candidates must be >= 1, got {max_candidates}")
        self.max_match = max_match
        self.min_match = min_match
        self.max_candidates = max_candidates

    @classmethod
    def from_config(cls, spec, model=None, engine_config=None) -> HistoryProposer:
        return cls()

    # -- the Proposer interface ------------------------------------------------------------

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        return [self._draft(req, k) for req in requests]

    def _draft(self, req: Request, k: int) -> Optional[Draft]:
        """The next k old tokens while aligned. evidence: tokens of agreement behind the
        alignment (the prompt and every output token while the old response has been followed
        from its start, else the re-alignment match plus the tokens that agreed since).
        confidence: how likely the old policy found each token (from the old logprobs)."""
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
        """Catches up only in steps the budget let it draft (`propose` catches up too), so a
        budget that has switched it off costs no bookkeeping per token."""
        if self in result.drafting:
            for row in result.rows:
                if row.req.history:
                    self._sync(row.req)
        for req in result.left:
            req.proposer_state.pop(self.name, None)
        return ()

    # -- alignment -------------------------------------------------------------------------

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
        """(position in hist right after the longest match of out's suffix (>= min_match
        tokens) that has a continuation, match length); ties go to the occurrence nearest
        after `anchor`."""
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
    """Position right after the occurrence of tok nearest to `anchor` (within `window`,
    at or after it first) that has a continuation; a single token is weak evidence, so only
    the neighbourhood of where the alignment was lost is searched."""
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


def _nearest_first(positions: list[int], anchor: int, limit: int):
    """Positions (ascending) in order: those >= anchor nearest first, then those below
    anchor nearest first; at most `limit` of them."""
    j = bisect.bisect_left(positions, anchor)
    taken = 0
    for i in range(j, len(positions)):
        if taken >= limit:
            return
        taken += 1
        yield positions[i]
    for i in range(j - 1, -1, -1):
        if taken >= limit:
            return
        taken += 1
        yield positions[i]
