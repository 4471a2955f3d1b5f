"""The draft budget: which proposer drafts for each request, and how many tokens, each step.

Deterministic given the run's acceptance counts and a step-cost table measured once (no clock is
read while a rollout runs). docs/architecture.md tells the whole rule; in short:

Acceptance. Token i of a draft is emitted with probability P_i = a_1 x ... x a_i, its *value*;
`a` is learnt per proposer, evidence level (token i at evidence + i, in powers of two) and
confidence bin, a bin's rate shrunk towards its level's, a level's towards `prior`.
Cost. A forward feeding F tokens costs `table(F)` seconds plus the attention over each token's
context, less for a draft token than for its row's first, and each row costs host work of its own
(rollout/budget/step_cost.py). A row's *share* of a step is the step's seconds over its rows.
The rule. A draft token is fed when its value times its row's share covers the seconds it adds to
the step: a token that lands is one the row need not emit in a later step, which costs a share;
the most valuable first, within the step's spare tokens. A fixed `min_draft_prob` instead floors
each token's value at min_draft_prob x load.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..core.request import Request
from ..proposers.base import Draft, Proposer
from .step_cost import StepCost

LEVELS = 7  # evidence levels: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+ tokens
CONFIDENCE_EDGES = (0.5, 0.75, 0.9, 0.97, 0.99)  # bins: unknown, then < 0.5, ..., >= 0.99
NUM_BINS = len(CONFIDENCE_EDGES) + 2
PRIOR_WEIGHT = 4.0  # trials' worth of trust in the coarser rate for a new level or bin
RUN_DECAY = 0.5  # each run halves the old counts, so the rates follow the policy as it trains
MIN_VALUE = 0.02  # a token less likely than this to land is never drafted: not worth its bookkeeping
STATE_VERSION = 2  # of `Budget.state_dict`


_LEVEL = [min(e.bit_length(), LEVELS - 1) for e in range(1 << (LEVELS - 1))]  # (read per draft token)


def level(evidence: int) -> int:
    return _LEVEL[evidence] if 0 <= evidence < len(_LEVEL) else (0 if evidence < 0 else LEVELS - 1)


def confidence_bin(q: Optional[float]) -> int:
    """0 for unknown (None, negative or NaN), else 1 + the number of edges q reaches."""
    if q is None or not q >= 0:
        return 0
    return 1 + bisect.bisect_right(CONFIDENCE_EDGES, q)


@dataclass(frozen=True)
class Offer:
    """A proposer's standing in one step: its rates, its best rate, and the most tokens that could earn."""

    proposer: Proposer
    table: list
    top: float
    most: int


@dataclass(frozen=True)
class StepPlan:
    """floor: the value every draft token must reach; cost: None with a fixed threshold."""

    floor: float
    offers: list
    cost: Optional[StepCost] = None

    @functools.cached_property
    def live(self) -> list:
        """The offers that may draft this step (read once per request)."""
        return [o for o in self.offers if o.most > 0]

    def judge(self, offer: Offer, draft: Draft, n: int) -> tuple[int, float, list]:
        """(tokens kept, expected accepted, their values) of the draft's first n tokens above the floor."""
        values, p, table, conf = [], 1.0, offer.table, draft.confidence or ()
        for i in range(n):  # token i's rate: at level(evidence + i) and its confidence's bin
            p *= table[level(draft.evidence + i)][confidence_bin(conf[i]) if i < len(conf) else 0]
            if p < self.floor:
                break
            values.append(p)
        return len(values), sum(values), values


def share(cost: StepCost, rows: int, fed: int, context: int) -> float:
    """A row's seconds of a step of `rows` rows feeding `fed` tokens over `context` tokens in all."""
    return (cost.table(fed) + cost.per_attended * context) / max(rows, 1) + cost.per_row


def longest(top: float, k: int, floor: float) -> int:
    """The most tokens n <= k with top**n >= floor."""
    n, p = 0, 1.0
    while n < k and p * top >= floor and top > 0:
        p *= top
        n += 1
    return n


@dataclass
class Budget:
    """min_draft_prob: None prices tokens by `cost` (set by the engine before its first run), a
    number fixes the floor at min_draft_prob x load; max_batch_for_spec: no drafts while more
    requests than this run."""

    max_draft_tokens: int = 8
    min_draft_prob: Optional[float] = None
    max_batch_for_spec: Optional[int] = None
    cost: Optional[StepCost] = None
    accepted: dict = field(default_factory=dict)  # name, (name, level), (name, level, bin) -> tokens
    trials: dict = field(default_factory=dict)
    _tables: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_spec(cls, spec) -> Budget:
        cost = StepCost.from_dict(spec.step_cost) if spec.step_cost is not None else None
        return cls(spec.max_draft_tokens, spec.min_draft_prob, spec.max_batch_for_spec, cost)

    @property
    def priced(self) -> bool:
        return self.min_draft_prob is None

    def new_run(self) -> None:
        for key in self.trials:
            self.accepted[key] *= RUN_DECAY
            self.trials[key] *= RUN_DECAY
        self._tables.clear()

    def record(self, req: Request, draft: Draft, accepted: int, judged: Optional[int] = None) -> None:
        """A verified draft: counted on the request and learnt from."""
        name = draft.proposer.name
        req.proposed[name] = req.proposed.get(name, 0) + len(draft.tokens)
        req.accepted[name] = req.accepted.get(name, 0) + accepted
        req.count_positions(name, accepted, len(draft.tokens) if judged is None else judged)
        self.learn(draft, accepted, judged)

    def learn(self, draft: Draft, accepted: int, judged: Optional[int] = None) -> None:
        """Its compared tokens (the accepted ones and the first mismatch, among the first `judged`:
        tokens past a request's end count as neither) are trials of their level and bin."""
        name, conf = draft.proposer.name, draft.confidence or ()
        trials = accepted + (accepted < (len(draft.tokens) if judged is None else judged))
        self._tables.pop(name, None)
        self._count(name, accepted, trials)
        for i in range(trials):
            lv, landed = level(draft.evidence + i), i < accepted
            self._count((name, lv), landed, 1)
            b = confidence_bin(conf[i]) if i < len(conf) else 0
            if b:
                self._count((name, lv, b), landed, 1)

    def _count(self, key, accepted: float, trials: float) -> None:
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted
        self.trials[key] = self.trials.get(key, 0.0) + trials

    def table(self, proposer: Proposer) -> list:
        """rates[level][bin] of the proposer; bin 0 (confidence unknown) is the level's rate."""
        if proposer.name not in self._tables:
            self._tables[proposer.name] = self._table(proposer.name, proposer.prior)
        return self._tables[proposer.name]

    def overall(self, proposer: Proposer) -> float:
        """The proposer's rate over all its compared tokens, shrunk towards its prior."""
        name = proposer.name
        return (self.accepted.get(name, 0.0) + 2 * proposer.prior) / (self.trials.get(name, 0.0) + 2)

    def _table(self, name: str, prior: float) -> list:
        acc, tri, w = self.accepted, self.trials, PRIOR_WEIGHT
        rows = []
        for lv in range(LEVELS):
            # a level shrinks towards the prior, not the other levels: the misses of short matches
            # early in a run must not keep a proposer from ever showing what its long matches land
            rate = (acc.get((name, lv), 0.0) + w * prior) / (tri.get((name, lv), 0.0) + w)
            rows.append([rate] + [(acc.get((name, lv, b), 0.0) + w * rate) / (tri.get((name, lv, b), 0.0) + w)
                                  for b in range(1, NUM_BINS)])
        return rows

    def state_dict(self) -> dict:
        def pairs(d):
            return [[list(k) if isinstance(k, tuple) else k, v] for k, v in d.items()]
        return {"version": STATE_VERSION, "accepted": pairs(self.accepted), "trials": pairs(self.trials)}

    def load_state_dict(self, state: dict) -> None:
        """Learnt counts; one of another format is ignored with a warning (it never changes a token)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            warnings.warn("draft budget state of an older format ignored: acceptance is learnt afresh", stacklevel=2)
            return
        def table(items):
            return {tuple(k) if isinstance(k, list) else k: float(v) for k, v in items}
        self.accepted, self.trials = table(state["accepted"]), table(state["trials"])
        self._tables.clear()

    def plan_step(self, proposers: Sequence[Proposer], running: int, load: float,
                  context: int = 0) -> Optional[StepPlan]:
        """The step's offers, None when it drafts nothing. context: what the requests attend over, summed."""
        if not proposers or running < 1 or (self.max_batch_for_spec is not None and running > self.max_batch_for_spec):
            return None
        k, offers = self.max_draft_tokens, []
        floor = self.min_draft_prob * min(max(load, 0.0), 1.0) if not self.priced else self.price(running, context)
        step = share(self.cost, running, running, context) * running if self.priced else 0.0  # a plain step's seconds
        for p in proposers:
            table = self.table(p)
            # a proposer's own cost per draft position (a draft head's forward) raises its floor; it
            # is paid for every request asked, before the draft's evidence and confidence are known,
            # so such a proposer is asked on its rate over all its drafts, not its best level's or bin's
            own = p.position_cost(running) / max(step, 1e-12) if self.priced else 0.0
            top = self.overall(p) if own > 0 else max(map(max, table))
            offers.append(Offer(p, table, top, longest(top, k, floor + own)))
        return StepPlan(floor, offers, self.cost if self.priced else None)

    def price(self, rows: int, context: int) -> float:
        """The value a first draft token must reach: a fed token's marginal cost in shares."""
        mean = context / max(rows, 1)
        fed = self.cost.marginal(rows) + self.cost.draft_attended * mean
        return max(fed / max(share(self.cost, rows, rows, context), 1e-12), MIN_VALUE)

    def choose(self, requests: Sequence[Request], rooms: Sequence[int], plan: StepPlan) -> list:
        """Per request (at most rooms[i] tokens): the draft, cut at the floor, with the longest expected
        accepted run, and its values, or None. Each proposer is asked once, where it could win."""
        best, runs = [None] * len(requests), [0.0] * len(requests)
        for offer in plan.live:
            caps = [min(offer.most, room) for room in rooms]
            ask = [i for i, cap in enumerate(caps) if cap and offer.top * cap > runs[i]]
            if not ask:
                continue
            drafts = offer.proposer.propose([requests[i] for i in ask], max(caps[i] for i in ask))
            for i, draft in zip(ask, drafts):
                if draft is None or not draft.tokens:
                    continue
                n, run, values = plan.judge(offer, draft, min(caps[i], len(draft.tokens)))
                if n and run > runs[i]:
                    best[i], runs[i] = (draft.cut(n), values), run
        return best

    def allocate(self, plan: StepPlan, values: Sequence[Sequence[float]], contexts: Sequence[int],
                 spare: int, fed: Optional[int] = None) -> list[int]:
        """Draft tokens per emitting request (values[i]: its draft's non-increasing token values;
        contexts[i]: what its first draft token attends over), at most `spare`, the most valuable
        first, each while its value times a row's share pays for it. fed: the step's tokens without drafts."""
        lengths = [0] * len(values)
        cost = plan.cost
        fed = len(values) if fed is None else fed
        row = share(cost, len(values), fed, sum(contexts)) if cost is not None else 0.0
        heap = [(-v[0], i) for i, v in enumerate(values) if v]
        heapq.heapify(heap)
        while heap and spare > 0:
            v, i = heapq.heappop(heap)
            if cost is not None:
                more = cost.marginal(fed) + cost.draft_attended * (contexts[i] + lengths[i] + 1)
                if -v * row < more:
                    continue  # the row's later tokens are worth less and cost more
                fed += 1
            lengths[i] += 1
            spare -= 1
            if lengths[i] < len(values[i]):
                heapq.heappush(heap, (-values[i][lengths[i]], i))
        return lengths
