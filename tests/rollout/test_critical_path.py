"""What the price credits an accepted draft follows the steps drafts really saved."""
import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import SamplingParams as SP
from rollout.controller import SHARE_PRIOR, AdaptiveController
from rollout.critical_path import RunTally, makespan
from rollout.request import Request
from tests.conftest import tiny_hf_model


def test_makespan_is_list_scheduling_over_the_slots():
    assert makespan([], 2) == 0
    assert makespan([5, 3, 4], 1) == 12
    assert makespan([5, 3, 4], 2) == 7  # the third takes the slot freed at 3
    assert makespan([5, 3, 4], 3) == 5


def _request(i):
    return Request(i, [1], SP(), i)


def test_a_lone_request_saves_every_accepted_token_as_a_step():
    tally, req = RunTally(slots=1), _request(0)
    tally.admit(req, 0)
    for _ in range(10):
        req.accepted["x"] = req.accepted.get("x", 0) + 1  # one accepted draft token a step
        tally.step([req])
    tally.leave(req, 10)
    assert tally.result() == (10.0, 10.0)


def test_one_of_many_equal_requests_saves_the_run_nothing():
    """The run ends with the slowest: drafts accepted by one request alone shorten nothing,
    though the price expected a share of a step for each of its tokens."""
    tally = RunTally(slots=4)
    reqs = [_request(i) for i in range(4)]
    for r in reqs:
        tally.admit(r, 0)
    reqs[0].accepted["x"] = 4
    tally.step(reqs)  # the lucky one is done after 6 steps, the others after 10
    tally.leave(reqs[0], 6)
    for r in reqs[1:]:
        tally.leave(r, 10)
    saved, expected = tally.result()
    assert saved == 0.0 and expected == pytest.approx(1.0)


def test_the_credit_follows_the_saved_steps_and_raises_the_price():
    c = AdaptiveController()
    c.cost.add_profile(8, 0.018)
    c.cost.add_profile(72, 0.082)  # 10 ms a step + 1 ms a token
    before = c.threshold(1.0, rows=8)
    assert c.critical_share == 1.0
    c.observe_run(saved=0.0, expected=9.0)  # drafts saved nothing of what they were priced for
    share = SHARE_PRIOR / (9 + SHARE_PRIOR)
    assert c.critical_share == pytest.approx(share)
    assert c.threshold(1.0, rows=8) == pytest.approx(0.001 / (0.001 + share * (0.018 / 8 - 0.001)))
    assert c.threshold(1.0, rows=8) > before
    for _ in range(8):  # later runs where they do save: the old evidence fades
        c.new_run()
        c.observe_run(saved=9.0, expected=9.0)
    assert c.critical_share > 0.95


def test_the_engine_tallies_its_runs_and_keeps_tokens():
    """One slot: every accepted draft token saves a step, as the price expects; two runs' tallies
    add up (the first halved by the second run's start)."""
    model = tiny_hf_model()
    prompts = [[5, 6, 7, 8], [9, 10, 11]] * 2
    params = SamplingParams(temperature=1.0, max_tokens=12)
    seeds = list(range(len(prompts)))
    plain = Engine.from_pretrained(model, EngineConfig(max_batch_size=1, max_model_len=64))
    spec = Engine.from_pretrained(model, EngineConfig(max_batch_size=1, max_model_len=64,
                                                      spec=SpecConfig(proposers=("history",))))
    ref = [o.token_ids for o in plain.generate(prompts, params, seeds=seeds)]
    totals = []
    for _ in range(2):  # drafts: the same seeds' responses, so every draft token lands
        out = spec.generate(prompts, params, seeds=seeds, drafts=ref)
        assert [o.token_ids for o in out] == ref
        totals.append(sum(sum(o.stats["accepted"].values()) for o in out))
    assert totals[0] > 0
    expected = totals[0] / 2 + totals[1]
    assert spec.controller.saved == pytest.approx([expected, expected])
    assert spec.controller.critical_share == pytest.approx(1.0)
