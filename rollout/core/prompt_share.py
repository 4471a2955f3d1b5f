"""Shared prompts: a GRPO group's samples compute their prompt's keys and values once.

The samples of a group share a prompt. The first of them to run computes it; the others wait a
step while it does, then copy its keys and values into their own slots (`KVCache.move` copies)
and go on from the prompt's last token, which each feeds itself: its logits start the response.
Copied keys and values are the bits each request would have computed: the forward gives a
position the same bits however many rows it computes (docs/architecture.md), so no token
changes. This is vLLM's prefix caching for the requests running at once, at prompt granularity.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from .request import Request


class Shares(NamedTuple):
    """copies: (request, donor, n): the donor's first n positions into the request's slot, before
    the step; held: ids of requests that feed nothing this step, their donor computing their prompt."""

    copies: list
    held: frozenset


NONE = Shares([], frozenset())


def plan(running: Sequence[Request]) -> Shares:
    """Which requests take their prompt from another running request, and which wait for one."""
    if all(r.num_cached >= _needed(r) for r in running):
        return NONE
    keys = [tuple(r.prompt_ids) for r in running]
    donors: dict[tuple, Request] = {}  # prompt -> the running request with most of it cached (first on ties)
    for r, key in zip(running, keys):
        d = donors.get(key)
        if d is None or min(r.num_cached, len(key)) > min(d.num_cached, len(key)):
            donors[key] = r
    copies, held = [], set()
    for r, key in zip(running, keys):
        d, n = donors[key], _needed(r)
        if d is r or r.num_cached >= n:
            continue
        if d.num_cached >= n:
            copies.append((r, d, n))
        elif r.num_cached == 0:  # the donor is computing it now: wait for it
            held.add(id(r))
    return Shares(copies, frozenset(held))


def _needed(req: Request) -> int:
    """The prompt positions a request can take from another: all of them but the last, which it
    feeds to get its first logits, unless it has output already (a continued request)."""
    return len(req.prompt_ids) - (0 if req.output_ids else 1)
