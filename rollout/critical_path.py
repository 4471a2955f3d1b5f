"""How many steps the accepted drafts of a run really saved, against what the price assumed.

The price (rollout/controller.py) values an accepted draft token at the share of a step it
saves: one step of its request, worth the step's fixed cost over the requests sharing it. That
holds when finishing one request early lets the others finish early too (a queue refills the
slot; the request is alone in the long tail). It fails where the run ends with the slowest of
many requests alike (equal lengths in full batches): a step saved by one of them saves nothing
unless every other saves it as well, so drafts there cost their slots and buy nothing.

So the engine tallies each run: every request's steps from admission to leaving and the draft
tokens it had accepted, plus what the price expected (accepted tokens over the requests running
at their step). At the run's end, list scheduling of the same requests in the same order over
the same slots, once with the steps they took and once with their accepted tokens added back
(as plain decoding would have taken them), gives the steps the drafts really saved. Their ratio
to the expected ones (`RunTally.result`) scales what the price credits an accepted token in
later runs.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field


def makespan(durations: list[int], slots: int) -> int:
    """Steps until every request is done when each, in order, takes the first slot to free."""
    free = [0] * max(slots, 1)
    end = 0
    for d in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + d)
        end = max(end, start + d)
    return end


@dataclass
class RunTally:
    slots: int
    admitted: dict = field(default_factory=dict)  # id(request) -> [order, step, accepted at admission, at last step]
    spans: list = field(default_factory=list)  # (steps taken, drafts accepted) per request, in admission order
    expected: float = 0.0  # steps the price expected the accepted drafts to save

    def admit(self, req, step: int) -> None:
        n = _accepted(req)
        self.admitted[id(req)] = [len(self.spans), step, n, n]
        self.spans.append((0, 0))

    def step(self, running: list) -> None:
        """After a step: each running request's newly accepted drafts saved it 1 / len(running) of a step."""
        new = 0
        for req in running:
            entry = self.admitted[id(req)]
            now = _accepted(req)
            new, entry[3] = new + now - entry[3], now
        self.expected += new / max(len(running), 1)

    def leave(self, req, step: int) -> None:
        order, start, before, _ = self.admitted.pop(id(req))
        self.spans[order] = (step - start, _accepted(req) - before)

    def result(self) -> tuple[float, float]:
        """(steps the drafts saved, steps the price expected them to save)."""
        taken = [d for d, _ in self.spans]
        plain = [d + a for d, a in self.spans]
        return float(makespan(plain, self.slots) - makespan(taken, self.slots)), self.expected


def _accepted(req) -> int:
    return sum(req.accepted.values())
