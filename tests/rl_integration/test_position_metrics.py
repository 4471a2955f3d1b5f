"""Acceptance per draft position: counted on each request, summed per call and per step."""
from rl_integration import metrics as M
from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.core.request import Request
from tests.conftest import tiny_hf_model


def test_a_request_counts_offered_and_accepted_positions():
    req = Request(index=0, prompt_ids=[1], params=SamplingParams(), seed=0)
    req.count_positions("history", accepted=2, judged=4)
    req.count_positions("history", accepted=0, judged=1)
    req.count_positions("suffix", accepted=3, judged=3)
    stats = req.stats()["by_position"]
    assert stats == {"history": [[2, 1, 1, 1], [1, 1]], "suffix": [[1, 1, 1], [1, 1, 1]]}
    assert M.position_rates(stats) == {"history": [0.5, 1.0, 0.0, 0.0], "suffix": [1.0, 1.0, 1.0]}
    copy = Request(index=0, prompt_ids=[1], params=SamplingParams(), seed=0)
    copy.set_stats(req.stats())
    copy.count_positions("history", accepted=1, judged=1)
    assert req.stats()["by_position"]["history"] == [[2, 1, 1, 1], [1, 1]]  # the copy shares no list
    assert M.add_positions({}, [stats, stats]) == {"history": [[4, 2, 2, 2], [2, 2]], "suffix": [[2, 2, 2], [2, 2, 2]]}


def test_history_drafts_equal_to_the_output_land_at_every_position_and_wrong_ones_at_none():
    hf = tiny_hf_model("llama", vocab=61, seed=3)
    prompts, seeds = [[5, 6, 7], [9, 1, 2]], [11, 12]
    params = SamplingParams(temperature=1.0, max_tokens=24)
    cfg = dict(max_batch_size=2, max_model_len=64)
    plain = Engine.from_pretrained(hf, EngineConfig(**cfg)).generate(prompts, params, seeds=seeds)
    spec = Engine.from_pretrained(hf, EngineConfig(**cfg, spec=SpecConfig(
        proposers=("history",), max_draft_tokens=4, min_draft_prob=0.0)))
    right = spec.generate(prompts, params, seeds=seeds, drafts=[o.token_ids for o in plain])
    assert [o.token_ids for o in right] == [o.token_ids for o in plain]
    rec = M.step_metrics(right, 1.0)
    assert rec["acceptance_by_position"]["history"] == [1.0] * 4
    offered, accepted = rec["by_position"]["history"]
    assert offered == accepted and sum(accepted) == rec["accepted"]["history"]
    wrong = [[(t + 1) % 61 for t in o.token_ids] for o in plain]  # never the sampled token
    rec = M.step_metrics(spec.generate(prompts, params, seeds=seeds, drafts=wrong), 1.0)
    rates = rec["acceptance_by_position"].get("history", [])
    assert rates and all(r == 0.0 for r in rates)
    assert M.aggregate([rec, rec])["by_position"]["history"][0] == [2 * x for x in rec["by_position"]["history"][0]]
