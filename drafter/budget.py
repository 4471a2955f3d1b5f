"""What the head's work is worth against what it costs, in the engine's own currency.

The controller (rollout/controller.py) values a draft token by the chance that it is reached and
accepted, in emitted tokens, and grants it when that beats the step's threshold (what its verify
slot costs, in emitted tokens). The head adds a cost the controller sees only as a whole: each
draft position is a batched forward, `fixed + per_request x n` seconds for n requests (measured
by the proposer). Two decisions in `DrafterProposer.prepare` weigh that cost against the tokens it
buys, converted at the engine's measured seconds per emitted token (`Pace`):

- `copy_limit`: whether to run the head for a request at all. Where a copy proposer (history,
  suffix, n-gram) already offers a draft worth about as much as the head's would be expected to
  be (the drafter's rate at the request's evidence level), the head's draft would not win, or win
  too little to pay for the request's rows in every position: it is not run for that request.
  A draft's worth is its surplus: the accepted tokens it is expected to earn less the price of
  the verify slots it fills (the controller's threshold per token).
- `worth_running`: whether the head runs this step at all: the drafted requests' expected gains
  over their copies against the whole step's head cost (first position, then each further one).
- `worth_another_position`: whether the next draft position pays: the tokens the still-live
  chains are expected to add there (each chain's chance of reaching it times the drafter's rate,
  less the verify slot's price) against one more batched forward.

A token the head adds over a request's copy draft is worth less than a plain step's share: the
request goes on at the copies' pace without it, about 1 + c tokens a step where its copy draft
this step earns c, so an extra token saves 1 / (1 + c) of the step share the controller values
it at (`over_copies`). Without that, where copies already land the head ran long chains whose
saved steps did not pay for them (docs/results.md, the GPU's demo).

Before the pace is measured (the first steps of a run) neither decision uses the head's cost:
the request is drafted when the head is expected to beat the copies, and positions follow the
controller's cut alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from rollout.controller import cut_surplus

DECAY = 0.9  # weight of the older steps in the pace


@dataclass
class Pace:
    """Seconds per emitted token of the engine this proposer runs in, measured between two of its
    `prepare` calls (one engine step, the head's own time included, as the controller counts it)
    over the tokens the step emitted (counted in `observe`). `idle()` forgets the last mark, so
    the gap between two rollouts is not taken for a step."""

    sums: list = field(default_factory=lambda: [0.0, 0.0])  # decayed seconds, tokens
    mark: Optional[float] = None
    emitted: int = 0

    def tick(self, now: float) -> None:
        if self.mark is not None and self.emitted > 0:
            self.sums = [self.sums[0] * DECAY + (now - self.mark), self.sums[1] * DECAY + self.emitted]
        self.mark, self.emitted = now, 0

    def count(self, tokens: int) -> None:
        self.emitted += tokens

    def idle(self) -> None:
        self.mark, self.emitted = None, 0

    def seconds_per_emitted(self) -> Optional[float]:
        return self.sums[0] / self.sums[1] if self.sums[1] > 0 else None


@dataclass
class PositionClock:
    """Times the draft positions after a chain's first, the ones `worth_another_position` decides
    about: the first also writes the catch-up rows and sets up the sampler, a cost of the step
    whatever its length. `mark(n, go)` where draft_chains asks whether n chains go on (the end of
    a position); `positions(end)`: (chains, seconds) of every position run after a mark."""

    marks: list = field(default_factory=list)

    def mark(self, n: int, go: bool) -> bool:
        self.marks.append((time.perf_counter(), n, go))
        return go

    def positions(self, end: float) -> list[tuple[int, float]]:
        out = []
        for j, (t, n, go) in enumerate(self.marks):
            if go:
                out.append((n, (self.marks[j + 1][0] if j + 1 < len(self.marks) else end) - t))
        return out


MAX_BACKOFF = 8  # steps


@dataclass
class Backoff:
    """After a step where the head was not worth running, the next few steps skip even the copy
    look-ups that decided it (1, 2, 4 ... MAX_BACKOFF steps while it stays unprofitable; back to
    every step once it runs): where copies win, as after the first RL step, the head's budget
    then costs a few look-ups per MAX_BACKOFF steps instead of every step."""

    left: int = 0
    length: int = 0

    def skip(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def result(self, ran: bool) -> None:
        self.length = 0 if ran else min(MAX_BACKOFF, max(1, 2 * self.length))
        self.left = self.length

    def reset(self) -> None:
        self.left = self.length = 0


def expected_surplus(rate: float, k: int, threshold: float) -> tuple[int, float]:
    """(tokens the controller would grant, what they earn beyond their verify slots' price, in
    accepted tokens: `cut_surplus`) of a k-token draft whose every token lands with `rate`."""
    n, _, surplus = cut_surplus([rate] * k, threshold)
    return n, surplus


def copy_limit(rate: float, k: int, threshold: float, per_request_s: float,
               seconds_per_emitted: Optional[float]) -> float:
    """The head is run for a request when the best copy draft's surplus is below this: its own
    expected surplus at `rate` less what the request's rows in the head's positions cost, in
    emitted tokens (that cost is left out while the pace is unknown). 0: never. Surpluses, not
    expected runs: a longer draft also feeds more tokens, and its verify slots are paid for
    whether they land or not."""
    n, surplus = expected_surplus(rate, k, threshold)
    if n == 0:
        return 0.0
    cost = 0.0 if seconds_per_emitted is None else per_request_s * n / seconds_per_emitted
    return max(0.0, surplus - cost)


def over_copies(copy: float) -> float:
    """What a token the head adds to a request is worth, as a share of a plain token's value, where
    the request's copy draft earns `copy` accepted tokens this step (taken as its pace in the
    steps after: 1 + copy tokens a step)."""
    return 1.0 / (1.0 + max(copy, 0.0))


def worth_running(gains: Sequence[tuple[float, int]], first_s: float, position_s: Callable[[int], float],
                  seconds_per_emitted: Optional[float]) -> bool:
    """Run the head this step at all: gains[i] = (request i's expected run over its best copy
    draft, in tokens; the draft positions it would fill). Together they must pay for the first
    position (catch-up rows, set-up) and each further one, run for the requests still drafting
    there. Always, while the pace is unknown."""
    if seconds_per_emitted is None or not gains:
        return seconds_per_emitted is None
    cost = first_s
    for p in range(1, max(n for _, n in gains)):
        cost += position_s(sum(1 for _, n in gains if n > p))
    return sum(g for g, _ in gains) * seconds_per_emitted >= cost


def worth_another_position(reach: Sequence[float], rates: Sequence[float], threshold: float, position_s: float,
                           seconds_per_emitted: Optional[float], worth: Optional[Sequence[float]] = None) -> bool:
    """Run one more batched position for the chains going on: reach[i] is chain i's chance of
    having been accepted so far, rates[i] the drafter's rate for its next token, worth[i] its token's
    share of a plain token's value (`over_copies`; None: all 1). Each token is worth its chance of
    landing less its verify slot's price (the threshold); together they must pay for the forward.
    Always, while the pace is unknown."""
    if seconds_per_emitted is None:
        return True
    worth = [1.0] * len(reach) if worth is None else worth
    gain = sum(w * max(0.0, r * a - threshold) for r, a, w in zip(reach, rates, worth))
    return gain * seconds_per_emitted >= position_s
