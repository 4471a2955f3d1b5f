"""The adaptive speculation budget: how many draft tokens each request gets this step.

A draft token costs a slot in the forward whether or not it is accepted; it pays only if it
is reached and accepted. Treat acceptance as geometric: each token of a proposer's draft is
accepted with probability `a` given the ones before it were, so token i is emitted with
probability a**i. The controller drafts only the tokens with a**i >= min_draft_prob, which
gives long drafts where a proposer has been right (history in the long tail) and none where
it has been wrong (n-gram guesses on a fresh policy), and decides between proposers by the
expected run sum(a**i).

`a` is estimated per request and proposer from verify trials (a trial is each compared draft
token: the accepted ones plus the first mismatch), shrunk towards the proposer's running
rate over all requests, which itself starts from the proposer's `prior` attribute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request

PRIOR_WEIGHT = 4.0  # trials' worth of trust in the all-requests rate for a new request
GLOBAL_DECAY = 0.5  # each run() halves the old evidence, so the rate follows the policy


@dataclass
class AdaptiveController:
    min_draft_prob: float = 0.3
    accepted: dict = field(default_factory=dict)  # proposer name -> accepted tokens (all requests)
    trials: dict = field(default_factory=dict)

    def new_run(self) -> None:
        for name in self.trials:
            self.accepted[name] *= GLOBAL_DECAY
            self.trials[name] *= GLOBAL_DECAY

    def rate(self, req: Request, proposer) -> float:
        name = proposer.name
        prior = getattr(proposer, "prior", 0.5)
        overall = (self.accepted.get(name, 0.0) + 2 * prior) / (self.trials.get(name, 0.0) + 2)
        return ((req.accepted.get(name, 0) + PRIOR_WEIGHT * overall)
                / (req.trials.get(name, 0) + PRIOR_WEIGHT))

    def draft_len(self, rate: float, k: int) -> int:
        """The longest n <= k whose last token is still emitted with probability >= min_draft_prob."""
        n, p = 0, 1.0
        while n < k and p * rate >= self.min_draft_prob:
            n, p = n + 1, p * rate
        return n

    def record(self, req: Request, name: str, proposed: int, accepted: int) -> None:
        trials = accepted + (1 if accepted < proposed else 0)
        req.proposed[name] = req.proposed.get(name, 0) + proposed
        req.accepted[name] = req.accepted.get(name, 0) + accepted
        req.trials[name] = req.trials.get(name, 0) + trials
        self.accepted[name] = self.accepted.get(name, 0.0) + accepted
        self.trials[name] = self.trials.get(name, 0.0) + trials


def expected_run(rate: float, n: int) -> float:
    return sum(rate ** (i + 1) for i in range(n))
