"""Shared prompts (rollout/core/prompt_share.py): a GRPO group computes its prompt once, and
every token and logprob is what the engine gives without sharing, with and without drafts, with
more samples than slots and in chunks."""
import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core import prompt_share
from rollout.core.request import Request
from tests.rollout.test_golden_replay import COST, PROMPTS, peaked_model

GROUP = 4


def run(dtype, share, spec=None, batch=6, chunks=None):
    """(tokens, logprobs, fed tokens) of GROUP samples of every prompt."""
    eng = Engine.from_pretrained(peaked_model(), EngineConfig(max_batch_size=batch, max_model_len=64, dtype=dtype,
                                                              spec=spec, share_prompts=share))
    ids = [p for p in PROMPTS for _ in range(GROUP)]
    groups = [i // GROUP for i in range(len(ids))]
    params = SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=[0])
    if chunks is None:
        outs = eng.generate(ids, params, seeds=list(range(len(ids))), groups=groups)
        return [o.token_ids for o in outs], [o.logprobs for o in outs], eng.last_run.fed_tokens
    reqs, fed = eng.make_requests(ids, params, list(range(len(ids))), groups=groups), 0
    while any(r.finish_reason is None for r in reqs):
        eng.run(reqs, max_new_tokens=chunks)
        fed += eng.last_run.fed_tokens
    return [r.output_ids for r in reqs], [r.logprobs for r in reqs], fed


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("batch", [6, 16])
def test_tokens_and_logprobs_are_the_same_with_prompts_shared(dtype, batch):
    tokens, logprobs, fed = run(dtype, share=False, batch=batch)
    for spec in (None, SpecConfig(proposers=("suffix", "lookahead"), step_cost=COST)):
        got, got_lp, got_fed = run(dtype, share=True, spec=spec, batch=batch)
        assert got == tokens
        assert got_lp == logprobs  # the same bits: copied keys and values are the ones it would compute
        if spec is None:  # each group's prompt but the first sample's last token is fed once, not GROUP times
            assert got_fed < fed


def test_requests_continued_in_chunks_share_their_prompts_too():
    tokens, logprobs, _ = run("float32", share=False)
    got, got_lp, _ = run("float32", share=True, chunks=5)
    assert got == tokens and got_lp == logprobs


def request(prompt, cached=0, output=()):
    req = Request(prompt_ids=list(prompt), params=SamplingParams(), seed=0, index=0)
    req.num_cached, req.output_ids = cached, list(output)
    return req


def test_a_sibling_waits_while_its_donor_computes_the_prompt_then_copies_it():
    donor, sibling, other = request([5, 6, 7]), request([5, 6, 7]), request([8, 9])
    first = prompt_share.plan([donor, sibling, other])
    assert first.copies == [] and first.held == {id(sibling)}  # the donor computes; a new prompt runs
    donor.num_cached = 3  # its prompt is in the cache now
    second = prompt_share.plan([donor, sibling, other])
    assert second.copies == [(sibling, donor, 2)] and not second.held  # all but the last: its logits start it
    continued = request([5, 6, 7], output=[4])  # a request with output takes the whole prompt
    assert prompt_share.plan([donor, continued]).copies == [(continued, donor, 3)]
    assert prompt_share.plan([request([5, 6, 7], cached=3), request([5, 6, 7], cached=4, output=[1])]) \
        == prompt_share.NONE  # nothing to take


def test_share_prompts_must_be_a_bool():
    with pytest.raises(ValueError, match="EngineConfig.share_prompts"):
        EngineConfig(share_prompts="yes").validate()
