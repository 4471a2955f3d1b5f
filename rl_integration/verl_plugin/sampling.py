"""verl's per-request sampling parameters as spectail's SamplingParams, and each request's seed.

As verl's vLLM server does, the response budget defaults to min(response_length, prompt_length +
response_length - prompt) within max_model_len; a setting the engine cannot honour
(repetition_penalty != 1, min_p, ...) is refused by name: the samples would not be the policy's.
A request's sample index is its arrival rank among this server's requests for the same prompt
in this step, and its seed `sample_seed(run seed, prompt_key(prompt ids), index, step)`, as in
every spectail backend; a request that names no group adds the replica rank to the index, so
siblings on different servers never share noise.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from rollout import SamplingParams
from rollout.core.seeds import prompt_key, sample_seed

ACCEPTED = ("temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
            "ignore_eos", "n")


def to_sampling_params(sp: dict[str, Any], rollout_config, prompt_len: int, max_model_len: int,
                       stop_token_ids) -> tuple[SamplingParams, bool]:
    """(SamplingParams, whether logprobs were asked for); ValueError naming a bad setting."""
    unknown = sorted(k for k in sp if k not in ACCEPTED)
    if unknown:
        raise ValueError(f"spectail's rollout server does not support sampling parameters {unknown}; "
                         f"it takes {list(ACCEPTED)}")
    if float(sp.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(f"repetition_penalty={sp['repetition_penalty']} is not supported by spectail: "
                         "the samples would not be samples of the policy")
    if int(sp.get("n", 1)) != 1:
        raise ValueError("spectail's server takes one sample per request (n=1); verl repeats the prompts")
    room = max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate within max_model_len "
                         f"{max_model_len} (actor_rollout_ref.rollout.max_model_len / prompt_length + response_length)")
    budget = sp.get("max_tokens", sp.get("max_new_tokens"))
    if budget is None:
        budget = min(rollout_config.response_length,
                     rollout_config.prompt_length + rollout_config.response_length - prompt_len)
    top_k = int(sp.get("top_k", -1))
    ignore_eos = bool(sp.get("ignore_eos", getattr(rollout_config, "ignore_eos", False)))
    params = SamplingParams(temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                            top_k=0 if top_k < 0 else top_k, max_tokens=max(1, min(int(budget), room)),
                            stop_token_ids=() if ignore_eos else tuple(int(t) for t in stop_token_ids))
    params.validate()
    return params, bool(sp.get("logprobs", False))


class SeedBook:
    """Sample indices per (prompt) within the current step, and the seeds they give."""

    def __init__(self, run_seed: int, replica_rank: int):
        self.run_seed, self.replica_rank = int(run_seed), int(replica_rank)
        self.step: Optional[int] = None
        self.counts: Counter = Counter()

    def set_step(self, step: int) -> None:
        if step != self.step:
            self.step, self.counts = step, Counter()

    def seed_for(self, prompt_ids, grouped: bool) -> int:
        key = prompt_key(prompt_ids)
        index = self.counts[key]
        self.counts[key] += 1
        if not grouped:
            index += self.replica_rank << 32
        return sample_seed(self.run_seed, key, index, self.step or 0)
