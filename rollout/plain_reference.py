"""What the same steps would have cost without speculation, measured, and the switch that turns
speculation off while it loses.

The price (rollout/controller.py) decides token by token from a model of the step cost; a model
can be wrong (host work per request that only drafting steps pay, a step cost that is not a line
in the tokens fed) and nothing in it would notice. So the engine also runs a plain step now and
then, with no proposer asked and no draft fed (a "probe"), and fits what a plain step costs from
those alone: `plain(fed)` seconds for a step that feeds `fed` tokens. A speculating step that fed
`fed` tokens, `drafted` of them drafts, for `rows` requests that each emitted at least one token,
and emitted `emitted` tokens in `seconds`, would have taken `emitted / rows` plain steps (one
token per request per step), the first feeding what it fed but its drafts (prompt chunks too:
`plain(fed - drafted)` seconds) and the others one token per request (`plain(rows)` each): a
prompt chunk is fed once however many tokens the step's drafts emit. The ledger sums both over
the recent speculating steps; once the speculating seconds exceed the plain ones, speculation is
off (every step plain, nothing asked) for a wait that doubles, up to MAX_OFF steps, with each
trial that loses clearly or loses again, so a workload whose drafts never land (or land just too
seldom to pay) pays for a trial of TRIAL steps every so often. Each run starts with a trial and a
trial that wins resets the wait: drafts that start landing (a new epoch's history, a trained
drafter) are back at once.

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
LEDGER_DECAY = 0.95  # per speculating step: the verdict follows the last few dozen steps
TRIAL = 6  # speculating steps' worth of evidence before the ledger may turn speculation off
MIN_OFF, MAX_OFF = 16, 256  # plain steps between trials: the first wait, and the longest
# Step timings on a shared machine move by tens of percent: a trial that lost by less than
# CLEAR_LOSS may have lost to the machine's noise, so the wait doubles only past it, or when the
# trial before it lost too.
CLEAR_LOSS = 1.2


@dataclass
class PlainReference:
    cost: StepCost = field(default_factory=StepCost)  # plain seconds per step against tokens fed, probes only
    probes: float = 0.0  # plain steps timed: probes and steps while off (decayed with the runs, like the rates)
    ledger: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # decayed (weight, seconds, plain seconds)
    since_probe: int = 0  # speculating steps since the last probe
    off_left: int = 0  # plain steps before the next trial
    wait: int = MIN_OFF  # the next off period's length
    lost: bool = False  # the last trial lost (and none has won since)

    @property
    def measured(self) -> bool:
        return self.probes > 0

    def new_run(self, decay: float) -> None:
        """A run starts with a trial (its drafts may land where the last run's did not: a new
        epoch's history), after a probe at its first step (its context lengths, hence the step
        cost, differ from the last run's). The wait a losing trial earned is kept."""
        self.probes *= decay
        self.since_probe, self.off_left = PROBE_EVERY, 0
        self.ledger = [0.0, 0.0, 0.0]

    def speculates(self) -> bool:
        """Whether the next step may draft: not while off, and not when a probe is due."""
        if self.off_left > 0:
            return False
        every = PROBE_EVERY if self.probes >= FIRST_PROBES else EARLY_PROBE_EVERY
        return self.since_probe < every

    def observe(self, planned: bool, fed: int, drafted: int, rows: int, emitted: int, seconds: float) -> None:
        """A step's outcome. planned: it ran with a draft budget (else it was plain: a probe, or
        a step while speculation is off)."""
        if not planned:
            self.off_left = max(self.off_left - 1, 0)
            if rows > 0:  # (a prefill chunk alone says little of decoding)
                self.cost.observe(fed, seconds)
                self.probes += 1
                self.since_probe = 0
            return
        self.since_probe += 1
        if rows <= 0 or not self.measured:
            return
        plain = self.cost.predict(max(fed - drafted, rows)) + (emitted / rows - 1) * self.cost.predict(rows)
        w, spent, saved = self.ledger
        self.ledger = [w * LEDGER_DECAY + 1, spent * LEDGER_DECAY + seconds, saved * LEDGER_DECAY + plain]
        if self.ledger[0] < _weight(TRIAL):
            return
        if self.ratio > 1:
            self._switch_off()
        else:  # a trial that wins: the next loss waits the shortest time again
            self.wait, self.lost = MIN_OFF, False

    def _switch_off(self) -> None:
        self.off_left = self.wait
        # (a slight loss once may be the machine's noise: try again as soon; twice, it is not)
        if self.ratio > CLEAR_LOSS or self.lost:
            self.wait = min(self.wait * 2, MAX_OFF)
        self.lost = True
        self.ledger = [0.0, 0.0, 0.0]  # the next trial is judged on its own steps

    def seconds_per_emitted(self, rows: int) -> Optional[float]:
        """What a plain step at `rows` decoding requests costs per token it emits, once measured."""
        return self.cost.predict(rows) / rows if self.measured and rows > 0 else None

    @property
    def ratio(self) -> float:
        """The recent speculating steps' seconds over what plain steps would have taken (< 1: a gain)."""
        w, spent, plain = self.ledger
        return spent / plain if plain > 0 else 1.0

    def state_dict(self) -> dict:
        return {"cost": self.cost.state_dict(), "probes": self.probes,
                "ledger": list(self.ledger), "wait": self.wait, "lost": self.lost}

    def load_state_dict(self, state: dict) -> None:
        self.cost = StepCost.from_state_dict(state["cost"])
        self.probes, self.wait = float(state["probes"]), int(state["wait"])
        self.lost = bool(state.get("lost", False))  # (absent from checkpoints of before it was kept)
        self.ledger = [float(x) for x in state["ledger"]]


def _weight(steps: int) -> float:
    """The ledger's weight after this many speculating steps."""
    return (1 - LEDGER_DECAY ** steps) / (1 - LEDGER_DECAY)
