"""EXPERIMENTAL: SPEC-RL's lenient acceptance (`SpecConfig.lenience`, off by default). BIASED:
outputs are no longer exact samples of the policy, and every token it accepts is counted in
stats["lenient"]. Tested in tests/rollout/test_history_exact.py (flagged, off by default), the
golden replay and tests/rl_integration (the run config and resume refuse to change it).

A draft token d that differs from the exact sample at response position t is still accepted
when the current policy gives it at least 1/l of the probability the old policy gave it:
log p_new(d) >= log p_old(d) - log l. Only tokens the draft's proposer can vouch for take part:
those the history proposer copied from the request's old response at the same position, whose old
logprob the request carries; the others are judged exactly.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..proposers.base import Draft
from ..proposers.history import HistoryProposer
from . import sampling
from .request import Request


def old_logprobs(req: Request, draft: Optional[Draft]) -> Optional[list[float]]:
    """The old logprob of each history draft token that sits where the old response had it (NaN
    elsewhere); None for another proposer's draft, or when the old logprobs are unknown."""
    old, hist, t = req.history_logprobs, req.history, len(req.output_ids)
    if draft is None or old is None or not isinstance(draft.proposer, HistoryProposer):
        return None
    return [old[t + i] if t + i < len(old) and hist[t + i] == d else math.nan for i, d in enumerate(draft.tokens)]


def new_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], temperature: torch.Tensor,
                 top_k: torch.Tensor, top_p: torch.Tensor) -> list[float]:
    """log_softmax(processed logits)[token] of each (logit row, draft token): what the current
    policy gives the drafted tokens."""
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    return sampling.token_logprobs(logits[index], temperature[index], top_k[index], top_p[index],
                                   torch.tensor(tokens, device=logits.device)).tolist()


def accept(draft: list[int], ys: list[int], lps: list[float], old: Optional[list[float]],
           new: Optional[list[float]], lenience: Optional[float]) -> tuple[int, int]:
    """(accepted, of which lenient): the draft tokens that equal the exact samples ys, or pass the
    lenient test; a leniently accepted token replaces its sample in ys (and lps) in place."""
    accepted = lenient = 0
    slack = None if lenience is None or old is None or new is None else math.log(lenience)
    while accepted < len(draft):
        if draft[accepted] != ys[accepted]:
            if slack is None or not new[accepted] >= old[accepted] - slack:
                break
            ys[accepted], lps[accepted] = draft[accepted], new[accepted]
            lenient += 1
        accepted += 1
    return accepted, lenient


def follows_old_response(req: Request, old: Optional[list[float]], draft: list[int], accepted: int) -> bool:
    """A request that went lenient keeps following its old response across drafts: when a whole
    draft of it was accepted and the old response goes on, the bonus sample is dropped and the
    last draft token re-fed, so the next draft's first token is judged leniently too."""
    return (req.lenient > 0 and old is not None and accepted == len(draft) > 0
            and len(req.output_ids) + accepted < len(req.history))
