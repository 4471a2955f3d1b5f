"""The adaptive budget drafts where drafts pay and stops where they do not, never changing a token."""
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import SamplingParams as SP
from rollout.controller import AdaptiveController, rates_from
from rollout.proposers.base import Draft, Proposer
from rollout.request import Request
from tests.conftest import tiny_hf_model


class Named(Proposer):
    def __init__(self, name, prior=0.5):
        self.name, self.prior = name, prior


def rate(c, p, evidence=0):
    """The proposer's acceptance rate at this evidence level, confidence unknown."""
    return rates_from(c.table(p), evidence, None, 1)[0]


def record(c, req, p, evidence, proposed, accepted, confidence=None):
    c.record(req, Draft(list(range(proposed)), p, evidence, confidence), accepted)


def test_draft_len_follows_the_acceptance_rate():
    c = AdaptiveController(min_draft_prob=0.3)
    assert c.draft_len(0.95, 16) == 16  # 0.95**16 = 0.44
    assert c.draft_len(0.9, 16) == 11  # 0.9**11 = 0.31, 0.9**12 = 0.28
    assert c.draft_len(0.5, 16) == 1
    assert c.draft_len(0.2, 16) == 0
    assert AdaptiveController(min_draft_prob=0.0).draft_len(0.01, 5) == 5


def test_rate_is_learnt_per_evidence_level():
    c = AdaptiveController()
    req = Request(0, [1], SP(), 0)
    p = Named("x", prior=0.5)
    assert rate(c, p, 0) == 0.5 and rate(c, p, 40) == 0.5
    for _ in range(10):
        record(c, req, p, evidence=20, proposed=4, accepted=4)  # long matches: right
        record(c, req, p, evidence=2, proposed=4, accepted=0)  # short matches: wrong
    assert rate(c, p, 20) > 0.9 and rate(c, p, 17) == rate(c, p, 20)  # one level: 16-31 tokens
    assert rate(c, p, 2) < 0.35
    assert c.trials["x"] == 50 and req.proposed["x"] == 80  # a mismatch ends the trials of a draft
    assert req.accepted["x"] == 40
    assert 0.7 < rate(c, p, 5) < 0.85  # an unseen level starts from the overall rate, 40 of 50
    c.new_run()
    assert rate(c, p, 20) > 0.85  # halved evidence, same rate
    assert rate(AdaptiveController(), Named("y", prior=0.9)) == 0.9


def test_useless_drafts_are_switched_off_and_tokens_unchanged():
    hf = tiny_hf_model("llama", vocab=211, seed=31)
    prompts = [[i, i + 1, i + 2] * 2 for i in range(1, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=40)
    seeds = list(range(8))
    always = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=64, spec=SpecConfig(
        proposers=("ngram",), max_draft_tokens=6, min_draft_prob=0.0)))
    adaptive = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=64, spec=SpecConfig(
        proposers=("ngram",), max_draft_tokens=6)))
    a, b = always.generate(prompts, params, seeds=seeds), adaptive.generate(prompts, params, seeds=seeds)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    proposed_always = sum(o.stats["proposed"].get("ngram", 0) for o in a)
    proposed_adaptive = sum(o.stats["proposed"].get("ngram", 0) for o in b)
    assert proposed_adaptive < proposed_always / 4, (proposed_adaptive, proposed_always)


def test_engine_counts_steps_without_drafts():
    hf = tiny_hf_model("llama", vocab=211, seed=32)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    params = [SamplingParams(temperature=1.0, max_tokens=n) for n in (3, 10, 10)]
    eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=32, spec=SpecConfig(
        proposers=("ngram",), max_batch_for_spec=2)))
    eng.generate(prompts, params, seeds=[1, 2, 3])
    run = eng.last_run
    assert run.steps > 0 and 0 < run.spec_off_steps < run.steps  # off while 3 run, on once fewer do
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=32))
    plain.generate(prompts, params, seeds=[1, 2, 3])
    assert plain.last_run.spec_off_steps == plain.last_run.steps > 0


def test_the_threshold_falls_with_the_load():
    c = AdaptiveController(min_draft_prob=0.3)
    assert c.draft_len(0.5, 16, load=1.0) == 1  # 0.5 >= 0.3 > 0.25
    assert c.draft_len(0.5, 16, load=0.5) == 2  # threshold 0.15
    assert c.draft_len(0.5, 16, load=0.125) == 4  # 0.0375: 0.5**4 = 0.0625 >= it > 0.5**5
    assert c.draft_len(0.99, 16, load=1.0) == 16  # capped by k


def test_rate_is_learnt_per_confidence_bin_and_cuts_before_an_unsure_token():
    c = AdaptiveController(min_draft_prob=0.3)
    req = Request(0, [1], SP(), 0)
    p = Named("x", prior=0.5)
    sure, unsure = 0.995, 0.4
    for _ in range(20):  # fresh noise: sure tokens land, unsure ones mostly do not
        record(c, req, p, 20, proposed=4, accepted=3, confidence=[sure, sure, sure, unsure])
    rates = rates_from(c.table(p), 20, [sure, sure, unsure, sure], 4)
    assert rates[0] == rates[1] == rates[3] > 0.9 and rates[2] < 0.2
    n, value = c.cut(rates, load=1.0)
    assert n == 2 and abs(value - (rates[0] + rates[0] ** 2)) < 1e-12  # stops before the unsure one
    assert rates_from(c.table(p), 20, None, 3) == [rate(c, p, 20)] * 3  # no confidence: the level's rate
    assert rates_from(c.table(p), 20, [-1.0, float("nan")], 2) == [rate(c, p, 20)] * 2  # unknown: likewise
    assert max(map(max, c.table(p))) == rates[0]
    a, b = rates[0], rates[2]
    n, value = c.cut(rates, load=0.01)  # the long tail: a long shot is worth its slot
    assert n == 4 and abs(value - (a + a * a + a * a * b + a * a * b * a)) < 1e-12


def test_the_default_threshold_is_chosen_by_device_and_bad_values_are_named():
    import pytest

    from rollout.controller import default_min_draft_prob
    assert default_min_draft_prob("cpu") == 0.3
    assert default_min_draft_prob("cuda:0") == 0.05  # a step's tokens are nearly free on a GPU
    hf = tiny_hf_model()
    by_device = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, spec=SpecConfig()))
    assert by_device.controller.min_draft_prob == 0.3
    given = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, spec=SpecConfig(min_draft_prob=0.1)))
    assert given.controller.min_draft_prob == 0.1
    with pytest.raises(ValueError, match="min_draft_prob"):
        SpecConfig(min_draft_prob=1.5).validate()
