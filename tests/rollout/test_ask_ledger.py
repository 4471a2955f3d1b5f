"""A proposer whose asks take more time than its drafts gain is asked in turns, never changing a token."""
import time

import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.ask_ledger import MAX_EVERY, MIN_ASKS, AskLedger
from rollout.config import SamplingParams as SP
from rollout.controller import AdaptiveController
from rollout.proposers.base import Draft, Proposer
from rollout.request import Request
from tests.conftest import tiny_hf_model


def test_every_is_the_asks_time_over_their_gain():
    led = AskLedger()
    assert led.every("x", 1.0, 0.1) == 1  # no asks yet: ask every step
    led.ask("x", seconds=MIN_ASKS * 0.002, count=int(MIN_ASKS))  # 2 ms an ask
    assert led.seconds_per_ask("x") == pytest.approx(0.002)
    assert led.every("x", 1.0, 0.1) == MAX_EVERY  # no draft gained anything
    led.drafted("x", proposed=10, accepted=10)
    assert led.every("x", 0.001, 0.0) == 2  # 10 ms gained for 16 ms of asks: every second step
    assert led.every("x", 0.01, 0.0) == 1  # 100 ms gained: every step
    assert led.every("x", 0.001, 0.001) == MAX_EVERY  # the fed tokens cost what they saved
    led.step()
    assert led.seconds_per_ask("x") == pytest.approx(0.002)  # fading keeps the ratio


def test_a_request_is_asked_once_in_every_turns():
    c = AdaptiveController(max_draft_tokens=4)
    c.cost.add_profile(8, 0.018)
    c.cost.add_profile(72, 0.082)
    p = type("Sure", (Proposer,), {"name": "x", "prior": 0.99})()
    c.ledger.ask("x", seconds=1.0, count=100)  # 10 ms an ask, nothing gained
    offer = c.plan_step([p], 8, 1.0).offers[0]
    assert offer.most > 0 and offer.every == MAX_EVERY
    for slot in range(3):
        asked = []
        for n in range(2 * MAX_EVERY):
            req = Request(0, [1], SP(), 0)
            req.slot, req.forward_passes = slot, n
            asked.append(p in c.plan_step([p], 8, 1.0).offered_to(req))
        assert sum(asked) == 2 and asked.index(True) < MAX_EVERY  # once per turn, whatever the slot
    c.ledger.drafted("x", proposed=1000, accepted=1000)  # now its drafts pay for its asks
    assert c.plan_step([p], 8, 1.0).offers[0].every == 1


class Oracle(Proposer):
    """Drafts the next token of the known output (always right), taking `delay` seconds an ask."""

    name = "oracle"
    catches_up = True

    def __init__(self, references, delay):
        self.references, self.delay, self.asks = references, delay, 0

    def propose(self, req, k):
        self.asks += 1
        time.sleep(self.delay)
        t = len(req.output_ids)
        ref = self.references[tuple(req.prompt_ids)]
        return Draft(list(ref[t:t + 1]), self) if t < len(ref) else None


@pytest.mark.parametrize("delay", [0.0, 0.005], ids=["cheap", "slow"])
def test_slow_asks_are_made_in_turns_and_cheap_ones_every_step(delay):
    hf = tiny_hf_model("llama", vocab=211, seed=33)
    prompts = [[i, i + 2, i + 4] for i in range(1, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=40)
    seeds = list(range(8))
    ref = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=64)).generate(prompts, params,
                                                                                               seeds=seeds)
    eng = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=64, spec=SpecConfig(
        proposers=("ngram",), max_draft_tokens=4)))
    oracle = eng.proposers[0] = Oracle({tuple(p): o.token_ids for p, o in zip(prompts, ref)}, delay)
    outs = eng.generate(prompts, params, seeds=seeds)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    decoding_steps = sum(o.stats["forward_passes"] for o in outs)
    if delay:  # 5 ms an ask against a fraction of a millisecond gained: asked in turns
        assert oracle.asks < decoding_steps / 3, (oracle.asks, decoding_steps)
    else:  # an ask costs microseconds and saves a step's share: asked nearly every step
        assert oracle.asks > 0.8 * decoding_steps, (oracle.asks, decoding_steps)
