"""What the same steps would have cost without speculation, measured; the switch that turns a
drafting policy off while it loses; and the choice between the two policies.

The price (rollout/controller.py) decides token by token from a model of the step cost; a model
can be wrong (host work per request that only drafting steps pay, a step cost that is not a line
in the tokens fed) and nothing in it would notice. So the engine also runs a plain step now and
then, with no proposer asked and no draft fed (a "probe"), and fits what a plain step costs from
those alone: `plain(fed, attended)` seconds for a step that feeds `fed` tokens attending over
`attended` tokens of context in all (decoding steps: one that feeds whole prompts is not fitted;
the context matters because a run's first steps read far less of it than its last). A probe right after a step
that drafted cuts a chain (the lookahead drafts from the samples a draft's rows yield, and a plain
step yields none), so probes come every EARLY_PROBE_EVERY steps after steps that drafted nothing,
where they cost about nothing, and only every PROBE_EVERY steps between drafting ones; the fit
fades between probes, as the machine's speed drifts. A speculating step that fed
`fed` tokens, `drafted` of them drafts, for `rows` requests that each emitted at least one token,
and emitted `emitted` tokens in `seconds`, would have taken `emitted / rows` plain steps (one
token per request per step), the first feeding what it fed but its drafts (prompt chunks too:
`plain(fed - drafted, ...)` seconds) and the others one token per request (`plain(rows, context)`
each, at the context the step leaves, growing by a token a request each step): a
prompt chunk is fed once however many tokens the step's drafts emit. A step whose drafts all
missed did at best what a plain step does, so it never reads as a gain, whatever the fit's error.
A policy's ledger sums both over its recent speculating steps; once the speculating seconds
reach the plain ones, that policy is off for a wait that doubles, up to MAX_OFF steps, with each
trial that loses clearly or loses again, so a workload whose drafts never land (or land just too
seldom to pay) pays for a trial every so often (TRIAL steps; SHORT_TRIAL once a trial lost and the
policy's record loses too). While the policy's longer record
wins, a losing stretch is likelier the machine's noise than a change: it waits MIN_OFF steps, and
the wait does not grow. Each run starts with a trial and a trial that wins resets the wait:
drafts that start landing (a new epoch's history, a trained drafter) are back at once. A run
that brings a draft source the last one lacked (history, after an epoch's first run without)
judges every policy afresh, on a long first trial (BURSTY_TRIAL steps): its first steps, before
the old responses are aligned, would otherwise decide on a short trial whether the whole run
waits out the waits earned without it. A verdict holds for the load it was reached at: once the
running requests fall to half of those a policy was switched off at (a run's tail, where a step
costs about the same with or without its drafts), its wait ends and a trial judges it there; and
whether its record wins (so that a losing stretch waits the least, and a trial after a lost one
is not a short one) is read at the load of that stretch (the tail's wins would otherwise keep a
policy that loses at a full batch trying every MIN_OFF steps, on full-length trials).

Two drafting policies take turns where both may run. "budget" is the controller's token-by-token
price. "eager" drafts every token a proposer offers, up to its draft length, as a fixed length
does: what a draft buys beyond its own tokens (the target's samples past a rejection, which the
lookahead drafts from in the next steps and which run on once one lands) the price cannot see
token by token, and a fixed length sometimes wins by it. Its length is halved after trials that
lose clearly or again, down to 2, and doubled back when a run starts with its record winning
(`Ledger.shorter`): a length that pays can lose at twice it. It starts at half the longest
(EAGER_START): drafts that land reach the longest in a run, while a first trial at the longest
where they seldom land loses by so much that its record keeps eager off long after its length
came down to one that pays. Eager runs only where a step that drafts in full at the longest
length costs at most EAGER_MAX_COST plain steps by the step-cost plane (a lone request on a CPU,
small batches or the long tail on a GPU), so what it loses is bounded. Each run prefers one
policy, which drafts where it may run and is not off (the other drafts where it may not run, and
while it is off only if the other's own record beats plain steps): the one whose
steps of the recent runs beat plain steps by more, one no run preferred yet first (what a policy
did standing in, on the steps the other left it, need not be like the rest), and the other one
for a run after EXPLORE_RUNS in a row. Runs, not steps, because gains come in bursts and a policy's drafts feed
the lookahead of the steps after it, whoever drafts them.

The plain cost per emitted token is also what an accepted draft token saves, which the price
uses once probes have measured it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .step_cost import StepCost

PROBE_EVERY = 64  # speculating steps between probes once the plain cost is known ...
FIRST_PROBES = 4  # ... until this many probes were timed, one every EARLY_PROBE_EVERY steps
EARLY_PROBE_EVERY = 8
PROBE_MAX_FEED = 2  # tokens fed per decoding request, at most, in a plain step that the fit takes
# Per speculating step, the probes so far fade by this: the machine's speed drifts, and the fit
# must follow it between probes, not the plain steps of a stretch long past.
PLAIN_FADE = 0.99
LEDGER_DECAY = 0.95  # per speculating step: the verdict follows the last few dozen steps
TRIAL = 6  # speculating steps' worth of evidence before the ledger may turn a policy off
# ... and for a policy whose last trial lost while its record loses too: its trials are what a
# workload whose drafts keep missing pays every run, and drafts that start landing save whole
# steps, which a few steps show.
SHORT_TRIAL = 3
MIN_OFF, MAX_OFF = 16, 256  # plain steps between trials: the first wait, and the longest
# Step timings on a shared machine move by tens of percent: a trial that lost by less than
# CLEAR_LOSS may have lost to the machine's noise, so the wait doubles only past it, or when the
# trial before it lost too.
CLEAR_LOSS = 1.2
POLICIES = ("budget", "eager")
EAGER_MAX_COST = 2.0  # plain steps' worth that a step drafting in full may cost for eager to run
# Where eager runs after the budget, the budget's record rides on the lookahead that eager's
# long drafts started: the budget is preferred only where its record is better by this much.
EAGER_EDGE = 0.1
EXPLORE_RUNS = 4  # runs in a row that prefer one policy before the other is preferred for one
BURSTY_TRIAL = 4 * TRIAL  # a bursty policy's first stretch (Ledger.bursty)
MAX_SHORTER = 3  # halvings of a bursty policy's draft length, at most (Ledger.shorter)
EAGER_START = 1  # ... and eager's halvings when no run has judged it yet


@dataclass
class Ledger:
    """One policy's speculating steps against what plain steps would have taken: its recent ones,
    which switch it off while it loses, and its longer record (`score`), by which the policies
    are compared."""

    sums: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decayed (weight, seconds, plain seconds)
    off_left: int = 0  # steps before its next trial
    wait: int = MIN_OFF  # the next off period's length
    lost: bool = False  # its last trial lost (and none has won since)
    # (seconds, plain seconds) over its steps of the recent runs (decayed by run): gains come in
    # bursts (a long draft that lands) and a policy's drafts feed the next steps' lookahead,
    # whoever drafts then, so only long stretches of steps compare two policies fairly.
    record: list = field(default_factory=lambda: [0.0, 0.0])
    # The same by load (running requests, in powers of two): whether a losing stretch is likelier
    # noise than a change is read from the steps at its own load, not from a run's tail, where
    # drafts win for little (`winning_at`).
    loads: dict = field(default_factory=dict)
    # Its gains come in bursts (eager: a long draft that lands, after many that do not): in a run
    # after runs where its record did not lose, it is judged on a longer first stretch; a losing
    # stretch switches it off only while its record does not win.
    bursty: bool = False
    # Halvings of a bursty policy's draft length: what pays at one length can lose at twice it
    # (a request's long drafts cost their rows, and a chain of lookahead drafts keeps going only
    # while every step drafts), so a trial that loses clearly or again halves it, and a run that
    # starts with its record winning tries it twice as long again.
    shorter: int = 0
    lenient: bool = True  # its score did not lose when this run started
    # Runs that preferred it: what it did as a stand-in (on the steps the preferred one left it,
    # which need not be like the rest) ranks it for no run.
    runs: int = 0
    # The requests running when it was last switched off: its verdict holds for that load (a
    # step's cost grows with its rows; a run's tail drafts nearly for free), so once as few as
    # half of them run, its wait ends (`PlainReference.choose`).
    off_rows: int = 0
    # Its next trial is a run's first since a new draft source came (PlainReference.new_run):
    # judged on a long stretch, as a run's first steps (the old responses not yet aligned, the
    # step cost fitted on the last run's contexts) say little of the rest, and it happens once.
    fresh: bool = False

    def trial(self, rows: int) -> int:
        """Its trial's length in speculating steps at this many running requests."""
        if self.fresh or (self.bursty and self.lenient):
            return BURSTY_TRIAL
        return SHORT_TRIAL if self.lost and not self.winning_at(rows) else TRIAL

    def judged(self, rows: int) -> bool:
        return self.sums[0] >= _weight(self.trial(rows)) - 1e-9  # (the sum and the closed form round apart)

    @property
    def ratio(self) -> float:
        """Its recent steps' seconds over what plain steps would have taken (< 1: a gain)."""
        w, spent, plain = self.sums
        return spent / plain if plain > 0 else 1.0

    @property
    def record_ratio(self) -> Optional[float]:
        """The same ratio over its record; None before it ever ran."""
        spent, plain = self.record
        return spent / plain if plain > 0 else None

    @property
    def score(self) -> Optional[float]:
        """Its record_ratio once a run preferred it, by which the policies are ranked."""
        return self.record_ratio if self.runs > 0 else None

    @property
    def winning(self) -> bool:
        ratio = self.record_ratio
        return ratio is not None and ratio < 1

    def winning_at(self, rows: int) -> bool:
        """Its record at about this many running requests wins (with none there: `winning`)."""
        spent, plain = self.loads.get(_load(rows), (0.0, 0.0))
        return spent < plain if plain > 0 else self.winning

    def add(self, seconds: float, plain: float, rows: int = 0) -> None:
        """A speculating step of `rows` requests took `seconds` where plain steps would have taken `plain`."""
        w, spent, saved = self.sums
        self.sums = [w * LEDGER_DECAY + 1, spent * LEDGER_DECAY + seconds, saved * LEDGER_DECAY + plain]
        self.record = [self.record[0] + seconds, self.record[1] + plain]
        load = self.loads.setdefault(_load(rows), [0.0, 0.0])
        load[0], load[1] = load[0] + seconds, load[1] + plain
        if not self.judged(rows):
            return
        self.fresh = False
        winning = self.winning_at(rows)
        if self.ratio >= 1 and (not self.bursty or not winning):  # (even: it gains nothing for its asks)
            self._switch_off(winning, rows)
        else:  # a trial that wins: the next loss waits the shortest time again
            self.wait, self.lost = MIN_OFF, False

    def _switch_off(self, winning: bool, rows: int) -> None:
        # While its record (at this load) wins, a losing stretch may be the machine's noise however
        # large: it waits the least. Else a slight loss once may be noise: it tries again as soon;
        # twice, or a clear loss, and the wait doubles.
        if winning:
            self.off_left = MIN_OFF
        else:
            self.off_left = self.wait
            if self.ratio > CLEAR_LOSS or self.lost:
                self.wait = min(self.wait * 2, MAX_OFF)
                if self.bursty:
                    self.shorter = min(self.shorter + 1, MAX_SHORTER)
        self.lost, self.off_rows = True, rows
        self.sums = [0.0, 0.0, 0.0]  # the next trial is judged on its own steps

    def state_dict(self) -> dict:
        return {"ledger": list(self.sums), "wait": self.wait, "lost": self.lost, "record": list(self.record),
                "loads": [[b, *x] for b, x in sorted(self.loads.items())],
                "runs": self.runs, "lenient": self.lenient, "shorter": self.shorter, "fresh": self.fresh}

    @classmethod
    def from_state_dict(cls, state: dict) -> Ledger:
        # (what is absent from older checkpoints starts afresh)
        return cls([float(x) for x in state.get("ledger", (0.0, 0.0, 0.0))], 0, int(state.get("wait", MIN_OFF)),
                   bool(state.get("lost", False)), [float(x) for x in state.get("record", (0.0, 0.0))],
                   loads={int(b): [float(x), float(y)] for b, x, y in state.get("loads", ())},
                   runs=int(state.get("runs", 0)), lenient=bool(state.get("lenient", True)),
                   shorter=int(state.get("shorter", 0)), fresh=bool(state.get("fresh", False)))


@dataclass
class PlainReference:
    cost: StepCost = field(default_factory=StepCost)  # plain seconds per step against tokens fed, probes only
    probes: float = 0.0  # plain steps timed: probes and steps while off (decayed with the runs, like the rates)
    ledgers: dict = field(default_factory=lambda: {p: _new_ledger(p) for p in POLICIES})
    preferred: str = POLICIES[0]  # the policy that drafts in this run's steps where it may
    kept: int = 0  # runs in a row that preferred it
    since_probe: int = 0  # speculating steps since the last probe
    drafted: bool = False  # the last speculating step fed drafts
    sources: frozenset = frozenset()  # the draft sources the last run brought (Engine.run: "history")

    @property
    def measured(self) -> bool:
        return self.probes > 0

    def new_run(self, decay: float, sources: frozenset = frozenset()) -> None:
        """A run starts with a trial (its drafts may land where the last run's did not: a new
        epoch's history), after a probe at its first step (its context lengths, hence the step
        cost, differ from the last run's). The waits losing trials earned are kept, unless the
        run brings a draft source the last one lacked (`sources`: an epoch's history after a
        first epoch without): they were earned without it, so each policy is judged afresh (on
        a long first trial, then the shortest wait). It prefers the policy with the better record, one no
        run preferred yet first, and the other one after EXPLORE_RUNS runs in a row."""
        self.probes *= decay
        self.since_probe = PROBE_EVERY  # (due at once: no interval is longer)
        fresh, self.sources = bool(sources - self.sources), frozenset(sources)
        for ledger in self.ledgers.values():
            ledger.off_left, ledger.sums = 0, [0.0, 0.0, 0.0]
            if fresh:
                ledger.wait, ledger.lost, ledger.fresh = MIN_OFF, False, True
            ledger.record = [x * decay for x in ledger.record]
            ledger.loads = {b: [x * decay for x in v] for b, v in ledger.loads.items()}
            ledger.lenient = (ledger.score or 0.0) < 1
            if ledger.winning and ledger.shorter > 0:
                ledger.shorter -= 1
        rank = {p: self._rank(p) for p in POLICIES}
        best = "budget" if rank["budget"] * (1 + EAGER_EDGE) < rank["eager"] else "eager"
        if best == self.preferred and self.kept >= EXPLORE_RUNS:
            best = next(p for p in POLICIES if p != best)
        self.kept = self.kept + 1 if best == self.preferred else 1
        self.preferred = best
        self.ledgers[best].runs += 1

    def _rank(self, policy: str) -> float:
        score = self.ledgers[policy].score
        return -1.0 if score is None else score  # (one no run preferred yet first)

    def eager_length(self, longest: int) -> int:
        """Eager's draft length now: `longest` halved by its losses (not under 2)."""
        return max(longest >> self.ledgers["eager"].shorter, min(longest, 2))

    def choose(self, eager_ok: bool = False, running: int = 0) -> Optional[str]:
        """The next step's drafting policy: the preferred one, or the other while the preferred
        one may not run, or is off and the other's record wins against plain; None: a plain
        step (a probe is due, or no policy may draft). eager_ok: a step drafting in full at the
        longest length would cost at most EAGER_MAX_COST plain steps. running: the requests the
        step runs (a policy switched off at twice as many or more is tried again)."""
        for ledger in self.ledgers.values():
            if ledger.off_left > 0 and 0 < 2 * running <= ledger.off_rows:
                ledger.off_left = 0
        every = PROBE_EVERY if self.probes >= FIRST_PROBES else EARLY_PROBE_EVERY
        # A probe after a step that drafted cuts its chain (the lookahead drafts from the samples
        # its draft rows yield); after one that drafted nothing it costs about nothing and keeps
        # the fit current, so there it comes every EARLY_PROBE_EVERY steps.
        if self.since_probe >= (every if self.drafted else EARLY_PROBE_EVERY):
            return None
        may_run = [p for p in POLICIES if eager_ok or p != "eager"]
        only_off = self.preferred in may_run  # (then a stand-in must win on its record)
        ready = [p for p in may_run if self.ledgers[p].off_left == 0
                 and (p == self.preferred or not only_off or (self.ledgers[p].record_ratio or 0.0) <= 1)]
        if not ready:
            return None
        return self.preferred if self.preferred in ready else ready[0]

    def observe(self, policy: Optional[str], fed: int, drafted: int, rows: int, emitted: int,
                seconds: float, work=None) -> None:
        """A step's outcome. policy: the one it drafted by (None: it was plain, a probe or a step
        while every policy was off). work: the context its attention read (rollout/engine.py
        `Work`; None: not counted)."""
        plain_attended, context = (work.plain, work.context) if work is not None else (0, 0)
        for name, ledger in self.ledgers.items():
            if name != policy:
                ledger.off_left = max(ledger.off_left - 1, 0)
        if policy is None:
            if rows > 0:  # (a prefill chunk alone says little of decoding)
                # A step mostly of prompt tokens is off the decoding line (a prompt's tokens share
                # their row's work; a run's first such step pays its one-time costs too): it is
                # not fitted, and until a decoding step was, the probe stays due.
                if fed <= PROBE_MAX_FEED * rows:
                    self.cost.observe(fed, seconds, plain_attended)
                    self.probes += 1
                elif not self.measured:
                    return
                self.since_probe = 0
            return
        self.since_probe += 1
        self.drafted = drafted > 0
        self.cost.fade(PLAIN_FADE)
        if rows <= 0 or not self.measured:
            return
        steps = emitted / rows  # (the ones after the first read rows more tokens each: the mean is used)
        plain = (self.cost.predict(max(fed - drafted, rows), plain_attended)
                 + (steps - 1) * self.cost.predict(rows, context + rows * max(steps - 2, 0) / 2))
        if emitted <= rows:  # no draft landed: at best it did what a plain step does, whatever the fit says
            plain = min(plain, seconds)
        self.ledgers[policy].add(seconds, plain, rows)

    def seconds_per_emitted(self, rows: int, context: int = 0) -> Optional[float]:
        """What a plain step at `rows` decoding requests whose tokens attend over `context` in all
        costs per token it emits, once measured."""
        return self.cost.predict(rows, context) / rows if self.measured and rows > 0 else None

    def state_dict(self) -> dict:
        return {"cost": self.cost.state_dict(), "probes": self.probes, "preferred": self.preferred, "kept": self.kept,
                "ledgers": {p: ledger.state_dict() for p, ledger in self.ledgers.items()},
                "sources": sorted(self.sources)}

    def load_state_dict(self, state: dict) -> None:
        self.cost = StepCost.from_state_dict(state["cost"])
        self.probes = float(state["probes"])
        ledgers = state.get("ledgers", {POLICIES[0]: state})  # (checkpoints from before eager: one ledger)
        self.ledgers = {p: Ledger.from_state_dict(ledgers[p]) if p in ledgers else _new_ledger(p) for p in POLICIES}
        for p, ledger in self.ledgers.items():
            ledger.bursty = p == "eager"
        self.preferred, self.kept = state.get("preferred", POLICIES[0]), int(state.get("kept", 0))
        self.sources = frozenset(state.get("sources", ()))


def _new_ledger(policy: str) -> Ledger:
    """A policy's ledger before any run judged it (eager's drafts start at EAGER_START halvings)."""
    eager = policy == "eager"
    return Ledger(bursty=eager, shorter=EAGER_START if eager else 0)


def _load(rows: int) -> int:
    """The load class of a step of `rows` requests: 1, 2-3, 4-7, ... rows."""
    return max(int(rows), 0).bit_length()


def _weight(steps: int) -> float:
    """The ledger's weight after this many speculating steps."""
    return (1 - LEDGER_DECAY ** steps) / (1 - LEDGER_DECAY)
