"""Turning a caller's prompts and options into validated Requests.

Everything is checked before a Request exists, so bad input raises a ValueError that names
the problem and no engine state is touched. Needs only the vocabulary size and max_model_len,
so a Ray driver validates exactly as a local engine does, without a model.
"""
from __future__ import annotations

import random
from typing import Iterable

from .config import SamplingParams
from .request import Request
from .seeds import MAX_SEED


def make_requests(vocab_size: int, max_model_len: int, prompt_token_ids, sampling_params=SamplingParams(),
                  seeds=None, drafts=None, groups=None, outputs=None, draft_logprobs=None) -> list[Request]:
    """seeds default to fresh random ones; drafts are previous responses (the "history"
    proposer), draft_logprobs their old logprobs (how sure the old policy was of each token), groups tie GRPO siblings,
    outputs are tokens already generated (to continue a divided rollout)."""
    n = len(prompt_token_ids)
    params = _per_prompt_params(sampling_params, n)
    if seeds is None:
        seeds = [random.getrandbits(63) for _ in range(n)]
    seeds = _per_prompt(seeds, n, "seeds")
    drafts = _per_prompt(drafts, n, "drafts")
    groups = _per_prompt(groups, n, "groups")
    outputs = _per_prompt(outputs, n, "outputs")
    draft_logprobs = _per_prompt(draft_logprobs, n, "draft_logprobs")
    requests = []
    for i in range(n):
        prompt = check_ids(prompt_token_ids[i], vocab_size, f"prompt {i}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) >= max_model_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; max_model_len is "
                             f"{max_model_len} and at least one must be left to generate")
        params[i].validate(vocab_size)
        seed = seeds[i]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
            raise ValueError(f"seeds[{i}] must be an integer in [0, 2**63), got {seed!r}")
        draft = None if drafts[i] is None else check_ids(drafts[i], vocab_size, f"drafts[{i}]")
        out = [] if outputs[i] is None else check_ids(outputs[i], vocab_size, f"outputs[{i}]")
        old_lps = None if draft_logprobs[i] is None else [float(x) for x in draft_logprobs[i]]
        if old_lps is not None and (draft is None or len(old_lps) != len(draft)):
            raise ValueError(f"draft_logprobs[{i}] must have one logprob per token of drafts[{i}]")
        requests.append(Request(index=i, prompt_ids=prompt, params=params[i], seed=seed, history=draft,
                                history_logprobs=old_lps, group=groups[i], output_ids=out,
                                logprobs=[float("nan")] * len(out)))
    return requests


def check_ids(ids: Iterable[int], vocab_size: int, what: str) -> list[int]:
    try:
        ids = [int(t) for t in ids]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of token ids") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return ids


def _per_prompt_params(value, n: int) -> list:
    if isinstance(value, SamplingParams):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"sampling_params has {len(value)} entries for {n} prompts")
    if not all(isinstance(v, SamplingParams) for v in value):
        raise ValueError("sampling_params must be a SamplingParams or a list of them")
    return value


def _per_prompt(value, n: int, what: str) -> list:
    if value is None:
        return [None] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
    return value
