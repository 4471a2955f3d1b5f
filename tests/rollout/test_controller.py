"""The adaptive budget drafts where drafts pay and stops where they do not, never changing a token."""
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.controller import AdaptiveController
from rollout.request import Request
from rollout.config import SamplingParams as SP
from tests.conftest import tiny_hf_model


class Named:
    def __init__(self, name, prior=0.5):
        self.name, self.prior = name, prior


def test_draft_len_follows_the_acceptance_rate():
    c = AdaptiveController(min_draft_prob=0.3)
    assert c.draft_len(0.95, 16) == 16  # 0.95**16 = 0.44
    assert c.draft_len(0.9, 16) == 11  # 0.9**11 = 0.31, 0.9**12 = 0.28
    assert c.draft_len(0.5, 16) == 1
    assert c.draft_len(0.2, 16) == 0
    assert AdaptiveController(min_draft_prob=0.0).draft_len(0.01, 5) == 5


def test_rate_learns_per_request_and_overall():
    c = AdaptiveController()
    good, bad = Request(0, [1], SP(), 0), Request(1, [1], SP(), 0)
    p = Named("x")
    assert c.rate(good, p) == 0.5
    for _ in range(10):
        c.record(good, "x", proposed=4, accepted=4)
        c.record(bad, "x", proposed=4, accepted=0)
    assert c.rate(good, p) > 0.85 and c.rate(bad, p) < 0.35
    assert good.trials["x"] == 40 and bad.trials["x"] == 10  # a mismatch ends the trials of a draft
    fresh = Request(2, [1], SP(), 0)
    assert 0.7 < c.rate(fresh, p) < 0.85  # 40 of 50 trials accepted overall, shrunk to the prior


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
    assert eng.steps > 0 and 0 < eng.spec_off_steps < eng.steps  # off while 3 run, on once fewer do
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=32))
    plain.generate(prompts, params, seeds=[1, 2, 3])
    assert plain.spec_off_steps == plain.steps > 0
