"""How often a proposer is worth asking: the host time its asks take against what they yield.

Asking a proposer for a draft is Python work per request and step (matching the context,
bringing its index up to date); the price (rollout/controller.py) weighs draft tokens against
their forward slots but not the asks that found them. In a full batch where the rates hover near
the price, a proposer is asked for every request every step and nearly every draft is cut to
nothing: the asks cost more than the drafts they find are worth.

So each proposer's asks are timed (the propose call and its catch-up work after the step) and
its drafts' outcome is tallied: the seconds their accepted tokens saved less the seconds their
fed tokens cost. Where that gain covers the asks' time, every request is asked every step; where
it does not, a request is asked every `every`-th step only (in turns, by slot), which spends
that much less on asking while still measuring what asks yield, so a proposer that starts
finding drafts (siblings have written more, a new epoch) is asked every step again within a few
dozen steps. Never switched off outright: an on/off gate starved of asks cannot see its yield
come back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .step_cost import DECAY

MAX_EVERY = 8  # a proposer is asked for a request at least every this many steps
MIN_ASKS = 8.0  # (decayed) asks before their yield is trusted


@dataclass
class AskLedger:
    asks: dict = field(default_factory=dict)  # name -> [decayed asks, decayed seconds]
    drafts: dict = field(default_factory=dict)  # name -> [decayed draft tokens fed, decayed accepted]

    def ask(self, name: str, seconds: float, count: int = 1) -> None:
        entry = self.asks.setdefault(name, [0.0, 0.0])
        entry[0] += count
        entry[1] += seconds

    def drafted(self, name: str, proposed: int, accepted: int) -> None:
        entry = self.drafts.setdefault(name, [0.0, 0.0])
        entry[0] += proposed
        entry[1] += accepted

    def step(self) -> None:
        """Once per engine step: old asks and drafts fade as the step cost's fit does."""
        for entry in (*self.asks.values(), *self.drafts.values()):
            entry[0] *= DECAY
            entry[1] *= DECAY

    def seconds_per_ask(self, name: str) -> float:
        """The measured host time of one ask (0 before any)."""
        asks, seconds = self.asks.get(name, (0.0, 0.0))
        return seconds / asks if asks > 0 else 0.0

    def every(self, name: str, token_value: float, token_cost: float) -> int:
        """Ask a request every this many steps: 1 while the asks' drafts gain (accepted tokens at
        `token_value` seconds, less fed draft tokens at `token_cost`) what the asks take, else the
        steps it takes the gain of one ask to pay for one ask, at most MAX_EVERY."""
        asks, seconds = self.asks.get(name, (0.0, 0.0))
        if asks < MIN_ASKS:
            return 1
        fed, accepted = self.drafts.get(name, (0.0, 0.0))
        gain = accepted * token_value - fed * token_cost
        if gain >= seconds:
            return 1
        return MAX_EVERY if gain <= 0 else min(MAX_EVERY, math.ceil(seconds / gain))

    def clear(self) -> None:
        self.asks.clear()
        self.drafts.clear()
