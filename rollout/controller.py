"""The adaptive speculation budget: how many draft tokens each request gets this step.

A draft token costs a slot in the forward whether or not it is accepted; it pays only if it
is reached and accepted. Treat acceptance as geometric: each token of a draft is accepted
with probability `a` given the ones before it were, so token i is emitted with probability
a**i. The controller drafts only the tokens with a**i >= min_draft_prob, which gives long
drafts where a proposer has been right (history in the long tail) and none where it has been
wrong (n-gram guesses on a fresh policy), and decides between proposers by the expected run
sum(a**i).

`a` depends less on the proposer than on how much context backs its draft: last epoch's
response followed from its first token is almost always right, the same response re-aligned
on a two-token match far less often, and a sibling's text matched on a whole line more often
than on one token. So each proposer reports its `evidence` for the draft (tokens of context
that agree with the source it copies from), and `a` is learnt per (proposer, evidence level)
from verify trials (a trial is each compared draft token: the accepted ones plus the first
mismatch), shrunk towards the proposer's rate over all levels, which itself starts from the
proposer's `prior` attribute. Levels are powers of two, so a level is a "how sure" bucket.

Within a draft, tokens differ too: a proposer that copies sampled text knows how likely the
policy that wrote each token found it (the old response's logprobs, a sibling's logprobs). With
fresh noise a copied token is accepted about as often as that probability, with a sample's own
old noise far more often; so a proposer may also report each draft token's `confidence`, and
`a` is then learnt per (proposer, evidence level, confidence bin), shrunk towards the level's
rate. A draft is cut where the product of its tokens' rates falls under the threshold, which
stops it right before the uncertain token instead of after an average number of tokens.

The threshold scales with the load (the fraction of slots in use). A full batch pays for
every draft token about what it pays for a request's token, so a draft token must be likely
to land. In the long tail a few requests are left, the step costs about the same with or
without their drafts (fixed overhead on a CPU, weight reads on a GPU), and the rollout ends
when the slowest of them does: a long shot is then worth its slot.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from .proposers.base import Draft, Proposer
from .request import Request

LEVELS = 7  # evidence levels: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+ tokens
PRIOR_WEIGHT = 4.0  # trials' worth of trust in the proposer's overall rate for a new level
GLOBAL_DECAY = 0.5  # each run() halves the old evidence, so the rates follow the policy
CONFIDENCE_EDGES = (0.5, 0.75, 0.9, 0.97, 0.99)  # bins: unknown, then < 0.5, ..., >= 0.99
NUM_BINS = len(CONFIDENCE_EDGES) + 2


def default_min_draft_prob(device) -> float:
    """The threshold when the config leaves it to the device. On a CPU a forward is compute-bound:
    a fed token costs a slice of the step whatever happens to it. On a GPU a decode step of a
    batch costs its weight reads and kernel launches, and its tokens are nearly free until a step
    carries hundreds of them; there the step count is what costs, and that is set by the slowest
    requests, so drafting past an unsure token pays. For a large model at full batch, whose steps
    do grow with their tokens, set min_draft_prob higher."""
    return 0.3 if torch.device(device).type == "cpu" else 0.05


def level(evidence: int) -> int:
    return min(max(int(evidence), 0).bit_length(), LEVELS - 1)


def confidence_bin(q: Optional[float]) -> int:
    """0 for unknown (None, negative or NaN), else 1 + the number of edges q reaches."""
    if q is None or not q >= 0:  # (NaN too: a continued request's earlier tokens)
        return 0
    return 1 + bisect.bisect_right(CONFIDENCE_EDGES, q)


@dataclass(frozen=True)
class Offer:
    """A proposer's standing in one step: its rate table, its best rate, and the most draft
    tokens that rate earns at this load (a proposer is never asked for more)."""

    proposer: Proposer
    table: list[list[float]]
    top: float
    most: int


@dataclass
class AdaptiveController:
    """The draft budget. min_draft_prob: the threshold (see the module docstring);
    max_draft_tokens: k; max_batch_for_spec: no drafts while more requests than this run."""

    min_draft_prob: float = 0.3
    max_draft_tokens: int = 8
    max_batch_for_spec: Optional[int] = None
    accepted: dict = field(default_factory=dict)  # name, (name, level), (name, level, bin) -> tokens
    trials: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec, device) -> AdaptiveController:
        threshold = spec.min_draft_prob if spec.min_draft_prob is not None else default_min_draft_prob(device)
        return cls(threshold, spec.max_draft_tokens, spec.max_batch_for_spec)

    def new_run(self) -> None:
        for key in self.trials:
            self.accepted[key] *= GLOBAL_DECAY
            self.trials[key] *= GLOBAL_DECAY

    # ---- one step ------------------------------------------------------------------------

    def offers(self, proposers: Sequence[Proposer], running: int, load: float) -> list[Offer]:
        """Each proposer's standing this step; [] when the step drafts nothing (no proposers, or
        more requests running than max_batch_for_spec: the step is compute-bound). Rates move only
        when a step is recorded, so a table is read once per step."""
        if self.max_batch_for_spec is not None and running > self.max_batch_for_spec:
            return []
        out = []
        for p in proposers:
            table = self.table(p)
            top = max(map(max, table))
            out.append(Offer(p, table, top, self.draft_len(top, self.max_draft_tokens, load)))
        return out

    def choose(self, req: Request, room: int, offers: Sequence[Offer], load: float) -> Optional[Draft]:
        """Ask every proposer for a draft, cut each where the budget stops granting tokens (by the
        evidence behind it, its tokens' confidence and this load), and take the one with the
        longest expected accepted run. A proposer is not asked when even its best rate could not
        beat the draft in hand."""
        best, best_value = None, 0.0
        for offer in offers:
            cap = min(offer.most, room)  # draft_len(top, k) = min(draft_len(top, K), k) for k <= K
            if cap == 0 or expected_run(offer.top, cap) <= best_value:
                continue
            draft = offer.proposer.propose(req, cap)
            if draft is None or not draft.tokens:
                continue
            n, value = self.cut(rates_from(offer.table, draft.evidence, draft.confidence,
                                           min(cap, len(draft.tokens))), load)
            if value > best_value:
                best, best_value = draft.cut(n), value
        return best

    def record(self, req: Request, draft: Draft, accepted: int) -> None:
        """A verified draft: its compared tokens (the accepted ones plus the first mismatch) are
        trials of its proposer's evidence level and of each token's confidence bin."""
        name, proposed = draft.proposer.name, len(draft.tokens)
        trials = accepted + (1 if accepted < proposed else 0)
        req.proposed[name] = req.proposed.get(name, 0) + proposed
        req.accepted[name] = req.accepted.get(name, 0) + accepted
        lv = level(draft.evidence)
        acc, tri = self.accepted, self.trials
        for key in (name, (name, lv)):
            acc[key] = acc.get(key, 0.0) + accepted
            tri[key] = tri.get(key, 0.0) + trials
        if draft.confidence is not None:
            for i, q in enumerate(draft.confidence[:trials]):
                b = confidence_bin(q)
                if b:
                    key = (name, lv, b)
                    acc[key] = acc.get(key, 0.0) + (i < accepted)
                    tri[key] = tri.get(key, 0.0) + 1

    # ---- rates and cuts ------------------------------------------------------------------

    def table(self, proposer: Proposer) -> list[list[float]]:
        """rates[level][bin] of this proposer now; bin 0 (confidence unknown) is the level's rate."""
        name, acc, trials = proposer.name, self.accepted, self.trials
        overall = (acc.get(name, 0.0) + 2 * proposer.prior) / (trials.get(name, 0.0) + 2)
        rows = []
        for lv in range(LEVELS):
            rate = (acc.get((name, lv), 0.0) + PRIOR_WEIGHT * overall) / (trials.get((name, lv), 0.0) + PRIOR_WEIGHT)
            rows.append([rate] + [(acc.get((name, lv, b), 0.0) + PRIOR_WEIGHT * rate)
                                  / (trials.get((name, lv, b), 0.0) + PRIOR_WEIGHT) for b in range(1, NUM_BINS)])
        return rows

    def draft_len(self, rate: float, k: int, load: float = 1.0) -> int:
        """The longest n <= k whose last token is still emitted with probability at least
        min_draft_prob x load (load: the fraction of the engine's slots in use)."""
        return self.cut(itertools.repeat(rate, k), load)[0]

    def cut(self, rates: Iterable[float], load: float = 1.0) -> tuple[int, float]:
        """(n, expected accepted tokens): the longest prefix of a draft whose last token is
        still reached and accepted with probability >= min_draft_prob x load."""
        threshold = self.min_draft_prob * min(max(load, 0.0), 1.0)
        n, p, value = 0, 1.0, 0.0
        for a in rates:
            if p * a < threshold:
                break
            n, p = n + 1, p * a
            value += p
        return n, value


def rates_from(table: list[list[float]], evidence: int, confidence: Optional[Sequence[float]],
               n: int) -> list[float]:
    """The acceptance rate of each of n draft tokens from a proposer's rate table."""
    row = table[level(evidence)]
    if confidence is None:
        return [row[0]] * n
    return [row[confidence_bin(q)] for q in itertools.islice(confidence, n)]


def expected_run(rate: float, n: int) -> float:
    """sum(rate**i for i in 1..n): the expected accepted tokens of an n-token draft."""
    if rate >= 1.0:
        return float(n)
    return rate * (1.0 - rate ** n) / (1.0 - rate)
