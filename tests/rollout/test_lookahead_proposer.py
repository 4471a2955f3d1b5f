"""The lookahead proposer drafts the target's own samples past a rejected draft token."""
import math

import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.budget.budget import Budget
from rollout.config import SamplingParams as SP
from rollout.core.request import Request
from rollout.proposers.base import Draft
from rollout.proposers.lookahead import LookaheadProposer
from rollout.proposers.ngram import NgramProposer
from tests.conftest import tiny_hf_model
from tests.rollout.proposer_sim import finish, observe, propose


def test_offers_the_samples_only_where_they_belong():
    r = Request(0, [1, 2], SP(), 0)
    p, other = LookaheadProposer(), NgramProposer()
    assert propose(p, r, 4) is None
    # a step drafted [6, 3, 3, 3] after [5]: 6 landed, 3 did not (the sample there was 4); the
    # samples past the rejection, 7 8 9, follow a wrong token and are kept to draft next
    r.output_ids = [5, 6, 4]
    lps = [math.log(q) for q in (0.5, 0.6, 0.9, 0.8, 0.7)]
    assert observe(p, r, Draft([6, 3, 3, 3], other), 1, [6, 4], [6, 4, 7, 8, 9], lps) == []
    d = propose(p, r, 2)
    assert d.tokens == [7, 8] and d.confidence == pytest.approx([0.9, 0.8]) and d.proposer is p
    r.output_ids.append(7)  # the output moved on without a step's result: stale
    assert propose(p, r, 2) is None
    assert p.state_sizes() == {"requests": 1}
    finish(p, r)
    assert p.state_sizes() == {"requests": 0}


def test_lookahead_drafts_are_lossless_and_taken():
    hf = tiny_hf_model("llama", vocab=97, seed=41)
    prompts = [[3, 4, 5, 3, 4, 5], [7, 8, 9, 10], [11, 12, 11, 12, 11]]
    params = SamplingParams(temperature=1.0, max_tokens=48)
    seeds = [4, 5, 6]
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=64))
    # n-gram guesses on a random model are mostly wrong: each rejection leaves a lookahead
    spec = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=64, spec=SpecConfig(
        proposers=("ngram", "lookahead"), max_draft_tokens=6, min_draft_prob=0.0)))
    ref, out = plain.generate(prompts, params, seeds=seeds), spec.generate(prompts, params, seeds=seeds)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.stats["accepted"].get("lookahead", 0) for o in out) > 0


def test_samples_no_draft_used_are_judged_against_what_was_emitted():
    p, other, c = LookaheadProposer(), NgramProposer(), Budget()
    req = Request(0, [1, 2, 3], SP(max_tokens=20), 0)
    req.output_ids = [5]  # a step emitted 5 where a draft was rejected at once: 7 8 9 kept for position 1
    assert observe(p, req, Draft([6, 1, 1], other), 0, [5], [5, 7, 8, 9], [-0.7] * 4) == []
    req.output_ids.append(7)  # the next step drafted nothing and emitted 7
    assert observe(p, req, None, 0, [7], [7], [-0.1]) == []  # all landed so far: judged further later
    req.output_ids += [8, 4]  # then the second lands, the third does not
    (judged,) = observe(p, req, Draft([8], other), 1, [8, 4], [8, 4], [-0.1, -0.1])
    draft, accepted, known = judged
    assert (draft.tokens, draft.proposer, draft.evidence, accepted, known) == ([7, 8, 9], p, 0, 2, 3)
    c.learn(draft, accepted, known)
    # token i is judged at the level of evidence 0 + i: levels 0, 1, 2 (2-3 tokens)
    counts = [(c.accepted[("lookahead", lv)], c.trials[("lookahead", lv)]) for lv in (0, 1, 2)]
    assert counts == [(1, 1), (1, 1), (0, 1)]
    assert req.proposed == {} and req.accepted == {}  # not one of the request's drafts

    req.output_ids.append(2)  # a step whose draft was rejected at once keeps 1 1 for the next position
    observe(p, req, Draft([3, 3], other), 0, [2], [2, 1, 1], [-0.7] * 3)
    d = propose(p, req, 4)
    assert d.tokens == [1, 1]
    req.output_ids += [1, 5]
    assert observe(p, req, d, 1, [1, 5], [1, 5, 5], [-0.7] * 3) == []  # drafted: its verify already judged it
