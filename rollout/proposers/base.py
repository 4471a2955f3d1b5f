"""What a draft source must do. Drafts are only guesses: the engine verifies every token
against the exact coupled sample, so a proposer can be wrong but never unsafe."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..request import Request


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k draft tokens that would follow req.prompt_ids + req.output_ids.
        Deterministic given the request's state; [] when it has nothing to offer."""
        ...

    def observe(self, req: Request, draft: list[int], num_accepted: int, emitted: list[int]) -> None:
        """Called after each verify step of req: `draft` was offered (possibly []),
        its first `num_accepted` tokens matched, and `emitted` were appended to the output."""
        ...

    # Optional: evidence(req) -> int, the tokens of context that back the draft just proposed
    # for req (0 = none known). The controller learns acceptance per evidence level
    # (rollout/controller.py); a proposer without it is judged at level 0.
    # Optional: confidence(req) -> list[float] | None, one per token of that draft: the
    # probability the policy gave the token where the proposer copied it from (negative or NaN
    # where unknown). The controller learns acceptance per confidence bin too.

    def finish(self, req: Request) -> None:
        """req leaves this engine: finished, or paused at the end of a chunk of a divided
        rollout (it may come back, here or on another worker). Drop per-request state."""
        ...
