"""Group speculation (Seer): the responses of a GRPO group (siblings in flight or finished, and
the group's past responses) draft for each other.

Each group has a suffix index over its responses: like a suffix tree it finds where the longest
suffix of a context occurs and what follows, but stores only positions. Every response is a token
list starting with a START marker (the shared prompt), and the index remembers where each
position's last 1, 2 and 4 tokens occurred: O(1) per token inserted, memory linear in tokens.

Drafting for a request:
1. match: the longest suffix (up to `max_depth` tokens) of [START] + output that occurs with a
   continuation, found from its longest indexed n-gram (newest first, at most `max_candidates`)
   and extended backwards; the occurrences of the longest length are kept.
2. follow: the most frequent next token among them (ties: smaller id) is drafted unless its share
   is under `min_share`; keep the occurrences that continue with it and repeat, up to k tokens.

A draft token's `confidence` is the probability the policy gave it at its newest occurrence that
knows it (-1 unknown): siblings share weights and, matched back to START, the context, so it is
the token's acceptance chance under fresh noise. A request's own tokens are indexed too; its
current end has no continuation, so it never matches itself trivially.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Optional

from ..core.request import Request
from .base import Draft, Proposer, StepResult

START = -1  # marks the start of a response (token ids are >= 0)
_NGRAMS = (4, 2, 1)  # indexed suffix lengths, longest first


class SuffixIndex:
    """Positional suffix index over the responses of one group."""

    __slots__ = ("seqs", "probs", "grams")

    def __init__(self):
        self.seqs: list[list[int]] = []  # each [START, t1, t2, ...]
        self.probs: list[list[float]] = []  # parallel to seqs: each token's probability, -1 unknown
        self.grams: tuple[dict, ...] = tuple(defaultdict(list) for _ in _NGRAMS)  # per n: n-gram -> [(seq, pos)]

    def new_sequence(self) -> int:
        s = len(self.seqs)
        self.seqs.append([START])
        self.probs.append([1.0])
        self.grams[_NGRAMS.index(1)][START].append((s, 1))
        return s

    def add_sequence(self, tokens, probs=None) -> int:
        s = self.new_sequence()
        self.extend(s, tokens, probs)
        return s

    def extend(self, s: int, tokens, probs=None) -> None:
        """Append tokens to sequence s; probs: one probability per token, or None (unknown)."""
        tokens = [int(t) for t in tokens]
        self.probs[s].extend([-1.0] * len(tokens) if probs is None else probs)
        seq = self.seqs[s]
        g4, g2, g1 = self.grams  # one per _NGRAMS, unrolled: this runs for every token
        for t in tokens:
            seq.append(t)
            end = len(seq)  # the n-gram seq[end-n:end] is followed by position `end`
            occ = (s, end)
            g1[t].append(occ)
            if end >= 2:
                g2[seq[-2], t].append(occ)
                if end >= 4:
                    g4[seq[-4], seq[-3], seq[-2], t].append(occ)

    def match(self, ctx: list[int], max_depth: int, max_candidates: int) -> tuple[int, list[tuple[int, int]]]:
        """(length, occurrences (seq, pos)) of the longest suffix of ctx (<= max_depth tokens)
        that has a continuation (pos < len(seq)); pos is where the continuation starts."""
        seqs = self.seqs
        limit = min(max_depth, len(ctx))
        for n, grams in zip(_NGRAMS, self.grams):
            if n > limit:
                continue
            key = tuple(ctx[-n:]) if n > 1 else ctx[-1]
            lst = grams.get(key)
            if not lst:
                continue
            best, found, seen = 0, [], 0
            for i in range(len(lst) - 1, -1, -1):  # newest first
                s, p = lst[i]
                seq = seqs[s]
                if p >= len(seq):
                    continue  # no continuation (e.g. the request's own end)
                seen += 1
                if seen > max_candidates:
                    break
                m = min(limit, p)  # seq[p-n:p] == ctx[-n:] by the index; siblings mostly agree all the
                if seq[p - m:p] != ctx[len(ctx) - m:]:  # way back, which one slice comparison (in C) shows
                    m = n
                    while m < limit and p - m - 1 >= 0 and seq[p - m - 1] == ctx[-m - 1]:
                        m += 1
                if m > best:
                    best, found = m, [(s, p)]
                elif m == best:
                    found.append((s, p))
            if found:
                return best, found
        return 0, []

    def follow(self, occs: list[tuple[int, int]], k: int, min_share: float) -> tuple[list[int], list[float]]:
        """Up to k tokens along the most frequent continuation of the occurrences, and their confidence."""
        live = [(self.seqs[s], self.probs[s], p) for s, p in occs]  # newest first
        draft, conf = [], []
        while live and len(draft) < k:
            if len(live) == 1:  # one source left: copy it (a response holds no START after 0)
                seq, probs, p = live[0]
                end = p + k - len(draft)
                draft.extend(seq[p:end])
                conf.extend(probs[p:end])
                break
            run = _agreed_run(live, k - len(draft))
            if run:  # every occurrence continues the same way for `run` tokens: take them at once
                seq, probs, p = live[0]
                draft.extend(seq[p:p + run])
                known = probs[p:p + run]
                total = sum(known)
                if min(known) < 0 or total != total:  # the newest occurrence does not know some (-1, NaN)
                    known = [q if q >= 0 else _newest_known(live, j) for j, q in enumerate(known)]
                conf.extend(known)
                live = [(seq, probs, p + run) for seq, probs, p in live]
                continue
            nexts = [seq[p] for seq, _, p in live if p < len(seq)]
            if not nexts:
                break
            tok = nexts[0]
            if nexts.count(tok) < len(nexts):  # a fork (siblings agree most of the time)
                counts = {t: nexts.count(t) for t in set(nexts)}
                tok, cnt = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
                if cnt < min_share * len(nexts):
                    break
            if tok < 0:
                break
            live = [(seq, probs, p + 1) for seq, probs, p in live if p < len(seq) and seq[p] == tok]
            draft.append(tok)
            conf.append(_newest_known(live, -1))
        return draft, conf


@dataclass
class _State:
    key: Optional[Hashable]  # the group's key in SuffixProposer._groups; None: a private index
    index: SuffixIndex  # the group's index when this request registered (or its private one)
    seq: int  # this request's sequence in that index


class SuffixProposer(Proposer):
    """Drafts from a per-group suffix index of the group's responses.

    min_share: the least share of the matched occurrences the drafted continuation needs.
    max_depth: the longest context suffix matched; max_candidates: occurrences examined per match.

    A request with group None gets a private index that goes with its state. A group's index
    outlives its requests; the caller frees it (`StepResult.dropped`) when the group is done, or a
    reused group id would draft from the wrong responses (harmless, but wasteful).
    """

    name = "suffix"

    def __init__(self, min_share: float = 0.3, max_depth: int = 32, max_candidates: int = 16):
        if not (0.0 <= min_share <= 1.0):
            raise ValueError(f"SuffixProposer.min_share must be in [0, 1], got {min_share}")
        if max_depth < 1:
            raise ValueError(f"SuffixProposer.max_depth must be >= 1, got {max_depth}")
        if max_candidates < 1:
            raise ValueError(f"SuffixProposer.max_candidates must be >= 1, got {max_candidates}")
        self.min_share, self.max_depth, self.max_candidates = min_share, max_depth, max_candidates
        self._groups: dict[Hashable, SuffixIndex] = {}

    def state_sizes(self) -> dict[str, int]:
        return {"groups": len(self._groups)}

    def _current(self, st: Optional[_State]) -> bool:
        """The state's index is still the one its group uses (not dropped, not replaced)."""
        return st is not None and (st.key is None or self._groups.get(st.key) is st.index)

    def _sync(self, req: Request) -> tuple[SuffixIndex, list[int]]:
        st = req.proposer_state.get(self.name)
        index = st.index if self._current(st) else None
        out = req.output_ids
        if index is not None:
            n = len(index.seqs[st.seq]) - 1  # output tokens indexed so far
            if n > len(out) or (n and index.seqs[st.seq][-1] != out[n - 1]):
                index = None  # the output was rewritten (O(1) check of the last indexed token)
        if index is None:
            st = self._register(req, st)
            index = st.index
        seq = index.seqs[st.seq]
        if len(seq) - 1 < len(out):
            n = len(seq) - 1
            index.extend(st.seq, out[n:], _probs(req.logprobs[n:], len(out) - n))
        return index, seq

    def _register(self, req: Request, st: Optional[_State]) -> _State:
        """A new sequence for the request in its group's index (first sight, a dropped group, a rewrite)."""
        fresh = not self._current(st)
        if req.group is None:
            key, index = None, (st.index if st is not None else SuffixIndex())
        else:
            key = ("group", req.group)
            index = self._groups.get(key)
            if index is None:
                index = self._groups[key] = SuffixIndex()
        if req.history and fresh:
            index.add_sequence(req.history, _probs(req.history_logprobs, len(req.history)))
        st = req.proposer_state[self.name] = _State(key=key, index=index, seq=index.new_sequence())
        return st

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        return [self._draft(req, k) for req in requests]

    def _draft(self, req: Request, k: int) -> Optional[Draft]:
        """evidence: the length of the context suffix the draft was matched on (a match back to
        START also matches the prompt, which the whole group shares). confidence: per token, the
        probability where it was sampled (-1 unknown)."""
        if k <= 0:
            return None
        index, ctx = self._sync(req)
        m, occs = index.match(ctx, self.max_depth, self.max_candidates)
        if not occs:
            return None
        tokens, confidence = index.follow(occs, k, self.min_share)
        evidence = m - 1 + len(req.prompt_ids) if m == len(ctx) else m
        return Draft(tokens, self, evidence=evidence, confidence=confidence)

    def on_step(self, result: StepResult) -> tuple:
        """Indexes members' new tokens only in steps the budget let it draft (else when asked or
        leaving): switched off, it costs nothing per token. A leaving member's response stays."""
        if self in result.drafting:
            for row in result.rows:
                self._sync(row.req)
        for req in result.left:
            st = req.proposer_state.get(self.name)
            if st is not None and st.key is not None and self._groups.get(st.key) is st.index:
                self._sync(req)
            req.proposer_state.pop(self.name, None)
        for group in result.dropped:
            self._groups.pop(("group", group), None)
        return ()


def _newest_known(live: list[tuple[list, list, int]], offset: int) -> float:
    """The probability of the token at p + offset in the newest occurrence that knows it (-1: none)."""
    return next((probs[p + offset] for _, probs, p in live if probs[p + offset] >= 0), -1.0)


def _agreed_run(live: list[tuple[list, list, int]], k: int) -> int:
    """How many tokens (<= k) every occurrence in live continues with alike (slices compare in C)."""
    seq0, _, p0 = live[0]
    run = min(k, min(len(seq) - p for seq, _, p in live))
    for seq, _, p in live[1:]:
        if run <= 0:
            return 0
        if seq[p:p + run] != seq0[p0:p0 + run]:
            j = 0
            while seq[p + j] == seq0[p0 + j]:
                j += 1
            run = j
    return max(run, 0)


def _probs(logprobs, n: int) -> Optional[list[float]]:
    """exp of n logprobs (NaN stays NaN: unknown), or None when they are missing or short."""
    if logprobs is None or len(logprobs) < n:
        return None
    return [math.exp(lp) for lp in logprobs[:n]]
