"""The lookahead proposer drafts the target's own samples past a rejected draft token."""
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import SamplingParams as SP
from rollout.proposers.lookahead import LookaheadProposer
from rollout.request import Lookahead, Request
from tests.conftest import tiny_hf_model


def test_offers_the_samples_only_where_they_belong():
    r = Request(0, [1, 2], SP(), 0)
    p = LookaheadProposer()
    assert p.propose(r, 4) is None
    r.output_ids = [5, 6]
    r.lookahead = Lookahead(position=2, tokens=[7, 8, 9], probs=[0.9, 0.8, 0.7])
    d = p.propose(r, 2)
    assert d.tokens == [7, 8] and d.confidence == [0.9, 0.8] and p.wants_lookahead
    r.output_ids.append(7)  # the output moved on without the engine refreshing it: stale
    assert p.propose(r, 2) is None
    p.finish(r)
    assert r.lookahead is None


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
    engine = Engine.from_pretrained(tiny_hf_model("llama", vocab=61, seed=3), EngineConfig(
        max_batch_size=2, max_model_len=32, spec=SpecConfig(proposers=("lookahead",), min_draft_prob=0.3)))
    c = engine.budget
    (req,) = engine.make_requests([[1, 2, 3]], SamplingParams(max_tokens=20), seeds=[0])
    req.output_ids = [5, 7]  # a step emitted 7 where samples [7, 8, 9] were kept for position 1
    req.lookahead = Lookahead(1, [7, 8, 9], [0.5, 0.5, 0.5])
    engine._judge_unused(req, drafted=False)
    assert req.judging is not None and not c.trials  # all landed so far: judged further later
    req.lookahead = None
    req.output_ids += [8, 4]  # the second lands, the third does not
    engine._judge_unused(req, drafted=False)
    assert req.judging is None
    # token i is judged at the level of evidence 0 + i: levels 0, 1, 2 (2-3 tokens)
    judged = [(c.accepted[("lookahead", lv)], c.trials[("lookahead", lv)]) for lv in (0, 1, 2)]
    assert judged == [(1, 1), (1, 1), (0, 1)]
    assert req.proposed == {} and req.accepted == {}  # not one of the request's drafts

    req.lookahead = Lookahead(len(req.output_ids), [1, 1], [0.5, 0.5])
    req.output_ids += [2]
    engine._judge_unused(req, drafted=True)  # drafted: its verify already judged it
    assert c.trials["lookahead"] == 3
