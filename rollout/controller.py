"""The draft budget: how many draft tokens each request gets this step, and from which proposer.

A draft token costs a slot in the forward whether or not it is accepted; it pays only if it
is reached and accepted. Token i of a draft is accepted with probability a_i given the ones
before it were, so it is emitted with probability a_1 x ... x a_i (its "value"). The controller
drafts only the tokens whose value reaches a threshold, which gives long drafts where a proposer
has been right (history in the long tail) and none where it has been wrong, and decides between
proposers by the expected run (the sum of the values).

`a` depends less on the proposer than on how much context backs its draft: last epoch's
response followed from its first token is almost always right, the same response re-aligned on
a two-token match far less often. So each proposer reports its `evidence` (tokens of context
that agree with the source it copies from), and `a` is learnt per (proposer, evidence level)
from verify trials (each compared draft token: the accepted ones plus the first mismatch),
shrunk towards the proposer's rate over all levels, which starts from the proposer's `prior`.
Levels are powers of two. Token i of a draft is reached only when the i before it were
accepted, which are i more tokens of agreement: it is judged, and learnt, at the level of
evidence + i. So a copy whose first token is a long shot but which runs on once it lands (the
target's own samples past a rejection, a re-aligned old response) gets long drafts, where
one rate for the whole draft would have cut it after a token. Within a draft, tokens differ
too: a proposer that copies sampled text knows how likely the policy found each token where it
was sampled (its `confidence`); with fresh noise a copied token lands about that often, so `a`
is also learnt per confidence bin and a draft is cut right before an unsure token.

The threshold is a price. A step costs `fixed + per_token x fed tokens + per_attended x context
they attend over` seconds, measured (rollout/step_cost.py), and emits tokens at some rate; a
draft token adds `cost = per_token + per_attended x its request's context` seconds and `value`
expected tokens, so it raises the rollout's throughput exactly when
`value / cost > emitted tokens / second`, i.e. when

    value >= cost x emitted tokens per second   (= seconds per draft token / seconds per emitted token).

On a compute-bound CPU step every fed token costs about what an emitted one does, so only sure
tokens pay; on a GPU, or in the long tail where a few requests are left and a step costs about
the same with or without their drafts, a long shot is worth its slot. An accepted token's worth
beyond its own slot is a share of a step, and that share is real only if the rollout ends
earlier for it: not when it ends with the slowest of many requests alike. Each run's tally
(rollout/critical_path.py) measures the steps drafts saved against those the price expected,
and their ratio (`critical_share`) scales that part of a token's worth in the runs after. With drafts that never
land the learnt rates fall under the price and speculation switches itself off; a small
exploration budget (about 1% of the time of the steps that may draft) keeps trying one token now
and then, so it switches back on when drafts start landing (a new epoch, a trained drafter). Asking a proposer
costs host time too, which the price per fed token charges to no draft: where a proposer's
chosen drafts have earned less over the run's last steps than its asks took, it is asked for a
share of the requests (`ask_share`). What an emitted token costs is measured on plain steps
that the engine runs now and then, and the same measure switches speculation off while its
steps lose to plain ones (rollout/plain_reference.py). Where drafting every offered token costs
little more than a plain step, that measure also compares the price with drafting in full (the
"eager" policy) and keeps whichever is faster: the value of a draft's rows to the lookahead in
later steps is what the price cannot see. A fixed `min_draft_prob` replaces the price by
`min_draft_prob x load` (load: the fraction of slots in use), deterministic, as tests and
benchmarks of draft lengths need.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import operator
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from . import step_cost
from .plain_reference import EAGER_MAX_COST, POLICIES, PlainReference
from .proposers.base import Draft, Proposer
from .request import Request
from .step_cost import DECAY, StepCost

LEVELS = 7  # evidence levels: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+ tokens
PRIOR_WEIGHT = 4.0  # trials' worth of trust in the proposer's overall rate for a new level
GLOBAL_DECAY = 0.5  # each run() halves the old evidence, so the rates follow the policy
CONFIDENCE_EDGES = (0.5, 0.75, 0.9, 0.97, 0.99)  # bins: unknown, then < 0.5, ..., >= 0.99
NUM_BINS = len(CONFIDENCE_EDGES) + 2
# The price never falls under this: a token that lands less often than this is not worth the
# proposing and bookkeeping, which the step timings cannot attribute to single tokens.
MIN_PRICE = 0.02
EXPLORE_FRACTION = 0.01  # of the measured step time, spent on one-token drafts under the price
SHARE_PRIOR = 0.25  # steps' worth of trust in the price's assumption that a saved step counts fully
MAX_SHARE = 2.0  # runs whose drafts saved more steps than expected (a long tail) raise the credit at most so much
# Asking a proposer costs host time whether or not its draft is used. A proposer whose asks have
# earned less than they cost is asked for this share of the requests at the least (so it is
# noticed when its drafts start to pay), for more in proportion to what its asks earn; the
# first MIN_ASKS asks are always made.
ASK_FLOOR = 1 / 16
MIN_ASKS = 4
# Asks are judged over a run's last few steps (their tallies decay by this each step, and a new
# run starts them afresh): what a proposer could not find a while ago (no siblings written yet,
# no old response in an epoch's first step) does not hold it back once it can.
ASK_DECAY = 0.9


def level(evidence: int) -> int:
    return min(max(int(evidence), 0).bit_length(), LEVELS - 1)


_LEVEL_OF = tuple(level(e) for e in range(1 << (LEVELS - 1)))  # evidence from here on is the top level


def levels(evidence: int, n: int) -> tuple:
    """level(evidence + i) for i < n: the levels of a draft's tokens (a table read, as this runs for
    every drafted token of every step)."""
    e = int(evidence)
    if e < 0:  # (as level: below no evidence is none)
        zeros = min(-e, max(n, 0))
        return (0,) * zeros + levels(0, n - zeros)
    head = _LEVEL_OF[e:e + n]
    return head if len(head) == n else head + (LEVELS - 1,) * (n - len(head))


def confidence_bin(q: Optional[float]) -> int:
    """0 for unknown (None, negative or NaN), else 1 + the number of edges q reaches."""
    if q is None or not q >= 0:  # (NaN too: a continued request's earlier tokens)
        return 0
    return 1 + bisect.bisect_right(CONFIDENCE_EDGES, q)


@dataclass(frozen=True)
class StepPlan:
    """What a step may draft: the value a draft token must reach, what a sample past a rejected
    draft token is worth as the next step's draft (0 when no proposer reads them), and each
    proposer's standing."""

    threshold: float
    lookahead: tuple  # a sample d positions past a rejected draft token lands with lookahead[d - 1]
    offers: list
    token_value: float = 0.0  # seconds an accepted draft token saves (0: unpriced): batched proposers budget by it
    token_cost: float = 0.0  # seconds a fed token costs (0: unpriced): what exploration pays per token
    policy: str = POLICIES[0]  # the drafting policy (rollout/plain_reference.py): "eager" drafts in full

    @property
    def drafts(self) -> bool:
        """Some proposer may draft more than exploration's one token this step."""
        return bool(self.live)

    def judge(self, offer: Offer, draft: Draft, n: int) -> tuple[int, float, float]:
        """`cut_surplus` of the draft's first n tokens, (n, expected accepted, surplus), by the
        offer's rates for the evidence behind it and its tokens' confidence."""
        return cut_surplus(rates_from(offer.table, draft.evidence, draft.confidence, n), self.threshold, self.lookahead)

    @functools.cached_property
    def live(self) -> tuple:
        """The offers that may draft this step (most > 0), in order."""
        return tuple(o for o in self.offers if o.most > 0)


@dataclass(frozen=True)
class Standing:
    """A proposer's rates as they stand: the table, its best rate, and the chance that token d
    of a draft from it (evidence 0, confidence unknown) lands (`lookahead_reach`)."""

    table: list
    top: float
    reach: tuple


@dataclass(frozen=True)
class Offer:
    """A proposer's standing in one step: its rate table, its best rate, the most draft tokens
    that rate earns at this load (a proposer is never asked for more), and the share of the
    requests it is asked for (`ask_share`)."""

    proposer: Proposer
    table: list[list[float]]
    top: float
    most: int
    share: float = 1.0

    @property
    def observed(self) -> bool:
        """Every request of the step may ask it: a proposer that only catches up in `observe`
        is told of each step (else it catches up when asked, rollout/proposers/base.py)."""
        return self.most > 0 and self.share >= 1.0


@dataclass
class AdaptiveController:
    """min_draft_prob: None prices draft tokens from the measured step cost (the default), a
    number fixes the threshold at min_draft_prob x load; max_draft_tokens: k; max_batch_for_spec:
    no drafts while more requests than this run."""

    min_draft_prob: Optional[float] = None
    max_draft_tokens: int = 8
    max_batch_for_spec: Optional[int] = None
    accepted: dict = field(default_factory=dict)  # name, (name, level), (name, level, bin) -> tokens
    trials: dict = field(default_factory=dict)
    cost: StepCost = field(default_factory=StepCost)
    emitted: list = field(default_factory=lambda: [0.0, 0.0])  # decayed (seconds, tokens emitted) of steps
    credit: float = 0.0  # seconds of exploration earned and not yet spent
    saved: list = field(default_factory=lambda: [0.0, 0.0])  # decayed (steps drafts saved, steps expected) of runs
    # Rate tables by proposer name, valid until the rates next move (record, new_run, a load):
    # a step that records nothing (speculation off) must not rebuild them.
    tables: dict = field(default_factory=dict, repr=False)
    # name -> decayed [asks, seconds they took, what they earned: the chosen drafts' surplus over
    # the price, in accepted tokens' worth], and the share of asks owed to each.
    asking: dict = field(default_factory=dict)
    ask_credit: dict = field(default_factory=dict)
    asked: float = 0.0  # seconds the step under way spent asking proposers (`observe_step` clears it)
    # Plain steps timed now and then, and whether speculating steps beat them (rollout/plain_reference.py).
    plain: PlainReference = field(default_factory=PlainReference)

    # Lenient acceptance keeps old tokens that a plain step would resample: its outputs depend on
    # which steps draft, so it never runs plain steps of its own accord.
    checks_plain: bool = True

    @classmethod
    def from_spec(cls, spec) -> AdaptiveController:
        return cls(spec.min_draft_prob, spec.max_draft_tokens, spec.max_batch_for_spec,
                   checks_plain=spec.lenience is None)

    @property
    def priced(self) -> bool:
        return self.min_draft_prob is None

    def new_run(self, sources: frozenset = frozenset()) -> None:
        """sources: the draft sources the run's requests bring (rollout/plain_reference.py)."""
        self.tables.clear()
        self.plain.new_run(GLOBAL_DECAY, sources)
        for key in self.trials:
            self.accepted[key] *= GLOBAL_DECAY
            self.trials[key] *= GLOBAL_DECAY
        self.saved = [x * GLOBAL_DECAY for x in self.saved]
        # Asks are judged within a run: an old response or a sibling missing in the last run
        # (an epoch's first step) says nothing of this one.
        self.asking.clear()
        self.ask_credit.clear()

    def end_run(self) -> None:
        """A run is over: what only spared its steps work (the cached tables) is dropped, so an
        idle engine holds what it learnt and nothing that depends on when its last run stopped."""
        self.tables.clear()

    def observe_run(self, saved: float, expected: float) -> None:
        """A run's accepted drafts saved `saved` steps where the price expected `expected`
        (rollout/critical_path.py)."""
        self.saved = [self.saved[0] + saved, self.saved[1] + expected]

    @property
    def critical_share(self) -> float:
        """The steps accepted drafts really save per step the price expects them to, shrunk
        towards 1 (the price's own assumption) by SHARE_PRIOR steps' worth of evidence."""
        saved, expected = self.saved
        return min(max((saved + SHARE_PRIOR) / (expected + SHARE_PRIOR), 0.0), MAX_SHARE)

    def state_dict(self) -> dict:
        """What it learnt (rates, step cost, exploration credit) as plain JSON: a resumed run's
        engine drafts as the uninterrupted one's would (exactly so with a fixed min_draft_prob)."""
        def pairs(d):
            return [[list(k) if isinstance(k, tuple) else k, v] for k, v in d.items()]
        return {"accepted": pairs(self.accepted), "trials": pairs(self.trials), "emitted": list(self.emitted),
                "credit": self.credit, "saved": list(self.saved),
                "cost": self.cost.state_dict(),
                "plain": self.plain.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        def table(items):
            return {tuple(k) if isinstance(k, list) else k: float(v) for k, v in items}
        self.accepted, self.trials = table(state["accepted"]), table(state["trials"])
        self.tables.clear()
        self.emitted, self.credit = [float(x) for x in state["emitted"]], float(state["credit"])
        self.saved = [float(x) for x in state.get("saved", (0.0, 0.0))]  # (checkpoints from before it was learnt)
        self.cost = StepCost.from_state_dict(state["cost"])
        self.plain = PlainReference()
        if "plain" in state:  # (checkpoints from before plain steps were timed)
            self.plain.load_state_dict(state["plain"])

    # ---- the price -----------------------------------------------------------------------

    def add_profile(self, tokens: int, seconds: float, attended: int = 0) -> None:
        """A timed forward of the engine's start-up profile: a prior for both step-cost planes."""
        self.cost.add_profile(tokens, seconds, attended)
        self.plain.cost.add_profile(tokens, seconds, attended)

    def policy(self, running: int, context: int = 0) -> Optional[str]:
        """The next step's drafting policy (rollout/plain_reference.py), None for a plain step: a
        priced budget runs plain steps while speculation loses, and now and then to time them,
        and tries drafting in full where such a step costs little more than a plain one.
        context: what the running requests' next tokens attend over, summed."""
        if not (self.priced and self.checks_plain):
            return POLICIES[0]
        plain = self.cost.predict(running, context)
        # Gated at the longest draft, not eager's length now (which starts short): where drafting the
        # longest could not pay, each run would pay eager's trials for nothing.
        n = self.max_draft_tokens + 1  # (drafts attend over the context and each other)
        full = self.cost.predict(running * n, n * context + running * step_cost.attended(0, n - 1))
        return self.plain.choose(eager_ok=0 < plain and full <= EAGER_MAX_COST * plain, running=running)

    def observe_step(self, fed: int, emitted: int, seconds: float, batched: float = 0.0, *,
                     rows: Optional[int] = None, drafted: int = 0,
                     policy: Optional[str] = POLICIES[0], work=None, observed: float = 0.0) -> None:
        """A step fed `fed` tokens (`drafted` of them drafts), emitted `emitted` for `rows`
        requests and took `seconds` (all of it: host work too), of which `batched` went to batched
        proposers (a draft head), priced by their own cost, and `observed` to telling the
        proposers its outcome. policy: the drafting policy it ran by (None: a plain step). work:
        the context its attention read (rollout/engine.py `Work`; None: not counted).
        The proposers' own host work (this step's asks, and `observed`) is left out of the step
        cost: it comes per request, not per fed token, and in bursts (a request's first ask
        indexes its old response), and one such burst in a run's first drafting steps would
        otherwise price draft tokens above what they save for the rest of the run. The asks are
        rationed by what they earn (`ask_share`), and the plain reference weighs whole steps."""
        attended = work.attended if work is not None else 0
        if self.priced and rows is not None:
            self.plain.observe(policy, fed, drafted, rows, emitted, seconds, work)
        self.cost.observe(fed, max(seconds - batched - observed - self.asked, 0.0), attended)
        self.asked = 0.0
        for stats in self.asking.values():
            stats[:] = [x * ASK_DECAY for x in stats]
        self.emitted = [self.emitted[0] * DECAY + seconds, self.emitted[1] * DECAY + emitted]
        # Only a step that may draft earns exploration: while every policy is off its trials
        # explore, and credit saved up over plain steps would be spent at once in the trial
        # (a token for every request), which it then loses.
        if policy is not None:
            self.credit = min(self.credit + EXPLORE_FRACTION * seconds, 1.0)

    def threshold(self, load: float, rows: int, context: int = 0) -> float:
        """The value a draft token must reach this step. rows: the requests that will emit (the
        rate before any step was timed is the profile's: one token per row); context: what
        their next tokens attend over, summed."""
        if not self.priced:
            return self.min_draft_prob * min(max(load, 0.0), 1.0)
        per_token = self.token_cost(rows, context)
        return _price(per_token, self.token_value(rows, per_token, context))

    def token_cost(self, rows: int, context: int = 0) -> float:
        """Seconds a draft token adds to a step: its slot, and its attention over its request's
        context (the running requests' mean)."""
        return self.cost.per_token() + self.cost.per_attended() * context / max(rows, 1)

    def token_value(self, rows: int, per_token: Optional[float] = None, context: int = 0) -> float:
        """Seconds an accepted draft token saves: its own slot (it is fed now instead of next
        step) plus its request's share of a step's remaining cost, as far as the runs so far
        show that a saved step shortens the rollout (`critical_share`). per_token: the cost of a
        draft token (`token_cost`), when the caller has it."""
        per_token = self.token_cost(rows, context) if per_token is None else per_token
        per_emitted = self.seconds_per_emitted(rows, context)
        return per_token + self.critical_share * max(per_emitted - per_token, 0.0)

    def seconds_per_emitted(self, rows: int, context: int = 0) -> float:
        """What an emitted token costs without speculation: a plain step's seconds over its rows,
        once plain steps were timed; before, the recent steps' seconds over their tokens (and
        before any step was timed, the profile's one token per row)."""
        plain = self.plain.seconds_per_emitted(rows, context)
        if plain is not None:
            return plain
        seconds, tokens = self.emitted
        if tokens <= 0:
            seconds, tokens = self.cost.predict(rows, context), rows
        return seconds / max(tokens, 1e-9)

    # ---- one step ------------------------------------------------------------------------

    def plan_step(self, proposers: Sequence[Proposer], running: int, load: float,
                  context: int = 0) -> Optional[StepPlan]:
        """The step's budget; None when it drafts nothing (more requests running than
        max_batch_for_spec: the step is compute-bound; or a plain step, `policy`). context: what
        the running requests' next tokens attend over, summed. Rates move only when a step is
        recorded, so a table is read once per step."""
        if not proposers or (self.max_batch_for_spec is not None and running > self.max_batch_for_spec):
            return None
        policy = self.policy(running, context)
        if policy is None:
            return None
        eager = policy == "eager"
        per_token = self.token_cost(running, context) if self.priced else 0.0
        value = self.token_value(running, per_token, context) if self.priced else 0.0
        threshold = 0.0 if eager else self.threshold(load, running, context)
        standings = [(p, self.standing(p)) for p in proposers]
        lookahead = max((s.reach for p, s in standings if p.wants_lookahead), default=(), key=sum)
        longest = self.plain.eager_length(self.max_draft_tokens) if eager else self.max_draft_tokens
        offers = []
        for p, s in standings:
            most = self.draft_len(s.top, longest, threshold, lookahead)
            if p.batched and self.priced:
                most = self._positions_worth(p, s.top, threshold, lookahead, running, value)
            # (a batched proposer's cost is its prepared positions, priced above: its asks are free)
            share = self.ask_share(p.name, value) if self.priced and not p.batched and not eager else 1.0
            offers.append(Offer(p, s.table, s.top, most, share))
        return StepPlan(threshold, lookahead, offers, value, per_token, policy)

    def _positions_worth(self, proposer: Proposer, top: float, threshold: float, lookahead: Sequence[float],
                         running: int, value: float) -> int:
        """Draft positions worth running for a proposer whose every position costs
        `position_cost(n)` for n requests at once (a draft head's batched forward): position i
        pays when its tokens, one per running request, are worth their slots plus that cost, i.e.
        when top**i >= threshold + position_cost(running) / (running x value), value: the seconds an
        accepted token saves (`token_value`).
        Once a position is run its cost is spent, so `choose` cuts the drafts at the plain
        threshold. With none worth it, the exploration budget may pay for one position."""
        n = max(running, 1)
        cost = proposer.position_cost(n)
        surcharge = cost / (n * max(value, 1e-9))
        most = self.draft_len(top, self.max_draft_tokens, threshold + surcharge, lookahead)
        if most == 0 and self.credit >= cost:
            self.credit -= cost
            most = 1
        return most

    def choose(self, req: Request, room: int, plan: StepPlan, free: int = 0) -> Optional[Draft]:
        """Ask every proposer for a draft, cut each where its tokens' value falls under the
        threshold (by the evidence behind it and its tokens' confidence), and take the one with
        the longest expected accepted run. A proposer is not asked when even its best rate could
        not beat the draft in hand. With none granted, `free` draft tokens (rows the step's
        forward computes anyway: a lone decode row runs as two, rollout/linear.py) are taken
        whatever they are worth when the price is measured; else exploration may try one token."""
        best, best_value, best_surplus = None, 0.0, 0.0
        for offer in plan.live:
            cap = min(offer.most, room)  # draft_len(top, k) = min(draft_len(top, K), k) for k <= K
            if cap == 0 or expected_run(offer.top, cap) <= best_value:
                continue
            if offer.share < 1.0 and not self._may_ask(offer.proposer.name, offer.share):
                continue
            draft = self._ask(offer.proposer, req, cap)
            if draft is None or not draft.tokens:
                continue
            n, value, surplus = plan.judge(offer, draft, min(cap, len(draft.tokens)))
            if value > best_value:
                best, best_value, best_surplus = draft.cut(n), value, surplus
        if best is not None and self.priced:
            self.asking[best.proposer.name][2] += best_surplus
        if best is None and self.priced and free > 0 and room > 0:
            best = self._free(req, plan, min(free, room))
        if best is None and self.priced and room > 0 and self.credit >= plan.token_cost:
            best = self._explore(req, plan)
        return best

    def _ask(self, proposer: Proposer, req: Request, k: int) -> Optional[Draft]:
        """proposer.propose(req, k), its time tallied where the price rations asks."""
        if not self.priced:
            return proposer.propose(req, k)
        draft, spent = self._timed_propose(proposer, req, k)
        stats = self.asking.setdefault(proposer.name, [0.0, 0.0, 0.0])
        stats[0], stats[1] = stats[0] + 1, stats[1] + spent
        return draft

    def _timed_propose(self, proposer: Proposer, req: Request, k: int) -> tuple[Optional[Draft], float]:
        """proposer.propose(req, k) and the seconds it took, which the step cost leaves out
        (`observe_step`)."""
        start = time.perf_counter()
        draft = proposer.propose(req, k)
        spent = time.perf_counter() - start
        self.asked += spent
        return draft, spent

    def ask_share(self, name: str, token_value: float) -> float:
        """The share of requests to ask this proposer for a draft: all while its asks earn their
        time (token_value: the seconds an accepted token saves), else at least ASK_FLOOR."""
        asks, seconds, earned = self.asking.get(name, (0.0, 0.0, 0.0))
        if asks < MIN_ASKS or token_value <= 0:
            return 1.0
        cost = seconds / token_value  # in accepted tokens' worth
        return 1.0 if earned >= cost else max(ASK_FLOOR, earned / cost)

    def _may_ask(self, name: str, share: float) -> bool:
        """Ration asks deterministically: a share s asks once per 1/s chances."""
        credit = self.ask_credit.get(name, 0.0) + share
        self.ask_credit[name] = credit - (credit >= 1.0)
        return credit >= 1.0

    @staticmethod
    def _free(req: Request, plan: StepPlan, n: int) -> Optional[Draft]:
        """n draft tokens from the most promising proposer that drafts per request (a batched
        one drafts only in the steps its offer prepared)."""
        offer = max((o for o in plan.offers if not o.proposer.batched), key=lambda o: o.top, default=None)
        draft = offer.proposer.propose(req, n) if offer is not None else None
        return draft.cut(n) if draft is not None and draft.tokens else None

    def _explore(self, req: Request, plan: StepPlan) -> Optional[Draft]:
        """One draft token from the most promising proposer, paid from the exploration credit."""
        offer = max(plan.offers, key=lambda o: o.top)
        draft, spent = self._timed_propose(offer.proposer, req, 1)
        # A token's slot and the ask's time, found or not: attempts that find nothing would
        # otherwise cost more host time than the credit says (every request every step).
        self.credit -= spent + plan.token_cost
        return draft.cut(1) if draft is not None and draft.tokens else None

    def record(self, req: Request, draft: Draft, accepted: int, judged: Optional[int] = None) -> None:
        """A verified draft: its compared tokens (the accepted ones plus the first mismatch) are
        trials of its proposer's evidence level and of each token's confidence bin. judged: how
        many of its tokens could count (fewer when the request ended inside the draft)."""
        name, proposed = draft.proposer.name, len(draft.tokens)
        req.proposed[name] = req.proposed.get(name, 0) + proposed
        req.accepted[name] = req.accepted.get(name, 0) + accepted
        self.learn(draft, accepted, judged)

    def learn(self, draft: Draft, accepted: int, judged: Optional[int] = None) -> None:
        """What `record` learns from a draft, also for one that was judged without being fed (the
        engine's kept samples past a rejection that no draft used: rollout/engine.py)."""
        name = draft.proposer.name
        trials = accepted + (1 if accepted < (len(draft.tokens) if judged is None else judged) else 0)
        acc, tri = self.accepted, self.trials
        self.tables.pop(name, None)
        acc[name] = acc.get(name, 0.0) + accepted
        tri[name] = tri.get(name, 0.0) + trials
        confidence = draft.confidence or ()
        for i, lv in enumerate(levels(draft.evidence, trials)):  # token i is judged after i accepted ones
            landed = i < accepted
            key = (name, lv)
            acc[key] = acc.get(key, 0.0) + landed
            tri[key] = tri.get(key, 0.0) + 1
            b = confidence_bin(confidence[i]) if i < len(confidence) else 0
            if b:
                key = (name, lv, b)
                acc[key] = acc.get(key, 0.0) + landed
                tri[key] = tri.get(key, 0.0) + 1

    # ---- rates and cuts ------------------------------------------------------------------

    def table(self, proposer: Proposer) -> list[list[float]]:
        """rates[level][bin] of this proposer now; bin 0 (confidence unknown) is the level's rate."""
        return self.standing(proposer).table

    def standing(self, proposer: Proposer) -> Standing:
        """The proposer's rate table with what every step reads of it, built once per change of
        its rates."""
        cached = self.tables.get(proposer.name)
        if cached is None:
            table = self._table(proposer)
            cached = self.tables[proposer.name] = Standing(table, max(map(max, table)),
                                                           lookahead_reach(table, self.max_draft_tokens))
        return cached

    def _table(self, proposer: Proposer) -> list[list[float]]:
        name, acc, trials = proposer.name, self.accepted, self.trials
        overall = (acc.get(name, 0.0) + 2 * proposer.prior) / (trials.get(name, 0.0) + 2)
        rows = []
        for lv in range(LEVELS):
            rate = (acc.get((name, lv), 0.0) + PRIOR_WEIGHT * overall) / (trials.get((name, lv), 0.0) + PRIOR_WEIGHT)
            rows.append([rate] + [(acc.get((name, lv, b), 0.0) + PRIOR_WEIGHT * rate)
                                  / (trials.get((name, lv, b), 0.0) + PRIOR_WEIGHT) for b in range(1, NUM_BINS)])
        return rows

    @staticmethod
    def draft_len(rate: float, k: int, threshold: float, lookahead: Sequence[float] = ()) -> int:
        """The longest n <= k whose tokens' values all reach the threshold (see `cut`)."""
        return AdaptiveController.cut(itertools.repeat(rate, k), threshold, lookahead)[0]

    @staticmethod
    def cut(rates: Iterable[float], threshold: float, lookahead: Sequence[float] = ()) -> tuple[int, float]:
        """(n, expected accepted tokens) of the longest prefix of a draft whose every token is
        worth the threshold. Token i is worth the chance P_i that it is reached and accepted, plus
        what the sample its row yields (the one at position i + 1) is worth past a rejection at
        or before it: the engine keeps those samples for the lookahead proposer, where a sample d
        positions past the rejection lands with chance lookahead[d - 1] (`lookahead_reach`). So
        R_i = sum over j <= i of P(first rejection at j) x lookahead[i - j] is added to P_i where
        P_i alone falls short: even a token that is rarely accepted is worth its row when the
        sample past it often lands (Jacobi-style decoding)."""
        return cut_surplus(rates, threshold, lookahead)[:2]


def _price(per_token: float, value: float) -> float:
    """The priced threshold when a fed token costs `per_token` seconds and an accepted one saves
    `value`."""
    return max(MIN_PRICE, per_token / value) if value > 0 else MIN_PRICE


def cut_surplus(rates: Iterable[float], threshold: float,
                lookahead: Sequence[float] = ()) -> tuple[int, float, float]:
    """`AdaptiveController.cut`, and the surplus of the tokens kept: the sum of what each is
    worth beyond the threshold (what a draft earns the rollout net of its verify slots, in
    accepted tokens' worth)."""
    n, p, value, surplus, failed = 0, 1.0, 0.0, 0.0, []
    reach = len(lookahead)
    for a in rates:  # (runs for every token of every draft judged: kept lean)
        failed.append(p * (1.0 - a))  # the chance the first rejection is at this token
        worth = p * a
        if worth < threshold:
            if reach:  # (n: this token's index, as every token before it was kept)
                lo = max(n - reach + 1, 0)  # rejections further back than the lookahead reaches add nothing
                worth += sum(map(operator.mul, failed[lo:], reversed(lookahead[:n - lo + 1])))
            if worth < threshold:
                break
        n += 1
        p *= a
        value += p
        surplus += worth - threshold
    return n, value, surplus


def rates_from(table: list[list[float]], evidence: int, confidence: Optional[Sequence[float]],
               n: int) -> list[float]:
    """The acceptance rate of each of n draft tokens from a proposer's rate table: token i is
    reached only after i accepted ones, which add i tokens of agreement to the draft's evidence.
    (`confidence_bin` is inlined: this runs for every token of every draft judged.)"""
    lv = levels(evidence, n)
    if confidence is None:
        return [table[i][0] for i in lv]
    edges, right = CONFIDENCE_EDGES, bisect.bisect_right
    return [table[i][0 if q is None or not q >= 0 else 1 + right(edges, q)] for i, q in zip(lv, confidence)]


def lookahead_reach(table: list[list[float]], n: int) -> tuple:
    """The chance that token d of a draft from this rate table (evidence 0, confidence unknown)
    lands, for d = 1..n: the product of the rates of tokens 1..d."""
    reach, p = [], 1.0
    for a in rates_from(table, 0, None, n):
        p *= a
        reach.append(p)
    return tuple(reach)


def expected_run(rate: float, n: int) -> float:
    """sum(rate**i for i in 1..n): the expected accepted tokens of an n-token draft."""
    if rate >= 1.0:
        return float(n)
    return rate * (1.0 - rate ** n) / (1.0 - rate)
