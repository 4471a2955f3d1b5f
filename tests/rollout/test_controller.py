"""The adaptive budget drafts where drafts pay and stops where they do not, never changing a token."""
import time

import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import SamplingParams as SP
from rollout.controller import (
    ASK_FLOOR,
    EXPLORE_FRACTION,
    MIN_ASKS,
    MIN_PRICE,
    AdaptiveController,
    level,
    levels,
    rates_from,
)
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
    t = c.threshold(load=1.0, rows=1)
    assert t == 0.3
    assert c.draft_len(0.95, 16, t) == 16  # 0.95**16 = 0.44
    assert c.draft_len(0.9, 16, t) == 11  # 0.9**11 = 0.31, 0.9**12 = 0.28
    assert c.draft_len(0.5, 16, t) == 1
    assert c.draft_len(0.2, 16, t) == 0
    assert c.draft_len(0.01, 5, AdaptiveController(min_draft_prob=0.0).threshold(1.0, 1)) == 5


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
    assert proposed_adaptive < proposed_always / 2, (proposed_adaptive, proposed_always)  # learning what fails
    again = adaptive.generate(prompts, params, seeds=seeds)  # it remembers: off, but for one-token exploration
    assert [o.token_ids for o in again] == [o.token_ids for o in a]
    for o in again:
        assert o.stats["proposed"].get("ngram", 0) <= o.stats["forward_passes"]


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
    assert c.draft_len(0.5, 16, c.threshold(1.0, 8)) == 1  # 0.5 >= 0.3 > 0.25
    assert c.draft_len(0.5, 16, c.threshold(0.5, 8)) == 2  # threshold 0.15
    assert c.draft_len(0.5, 16, c.threshold(0.125, 8)) == 4  # 0.0375: 0.5**4 = 0.0625 >= it > 0.5**5
    assert c.draft_len(0.99, 16, c.threshold(1.0, 8)) == 16  # capped by k


def test_rate_is_learnt_per_confidence_bin_and_cuts_before_an_unsure_token():
    c = AdaptiveController(min_draft_prob=0.3)
    req = Request(0, [1], SP(), 0)
    p = Named("x", prior=0.5)
    sure, unsure = 0.995, 0.4
    for _ in range(20):  # fresh noise: sure tokens land, unsure ones mostly do not
        record(c, req, p, 20, proposed=4, accepted=3, confidence=[sure, sure, sure, unsure])
    rates = rates_from(c.table(p), 20, [sure, sure, unsure, sure], 4)
    assert rates[0] == rates[1] == rates[3] > 0.9 and rates[2] < 0.2
    n, value = c.cut(rates, c.threshold(1.0, 8))
    assert n == 2 and abs(value - (rates[0] + rates[0] ** 2)) < 1e-12  # stops before the unsure one
    assert rates_from(c.table(p), 20, None, 3) == [rate(c, p, 20)] * 3  # no confidence: the level's rate
    assert rates_from(c.table(p), 20, [-1.0, float("nan")], 2) == [rate(c, p, 20)] * 2  # unknown: likewise
    assert max(map(max, c.table(p))) == rates[0]
    a, b = rates[0], rates[2]
    n, value = c.cut(rates, c.threshold(0.01, 8))  # the long tail: a long shot is worth its slot
    assert n == 4 and abs(value - (a + a * a + a * a * b + a * a * b * a)) < 1e-12


def test_the_step_cost_is_fitted_from_timings_and_anchored_by_the_profile():
    from rollout.step_cost import StepCost

    cost = StepCost()
    assert cost.fit() == (0.0, 0.0)
    cost.add_profile(8, 0.010 + 8 * 0.001)
    cost.add_profile(72, 0.010 + 72 * 0.001)
    assert cost.fit() == pytest.approx((0.010, 0.001))
    for _ in range(200):  # steps of one size only: the slope stays the profile's
        cost.observe(16, 0.010 + 16 * 0.001)
    assert cost.fit() == pytest.approx((0.010, 0.001))
    for n in range(1, 200):  # steps that vary move the fit to the machine as it is now
        cost.observe(n % 40 + 1, 0.002 + (n % 40 + 1) * 0.004)
    fixed, per_token = cost.fit()
    assert per_token == pytest.approx(0.004, rel=0.1) and fixed < 0.01


def test_the_price_is_seconds_per_fed_token_over_seconds_per_emitted_token():
    c = AdaptiveController()  # priced (the default)
    c.cost.add_profile(8, 0.018)
    c.cost.add_profile(72, 0.082)  # 10 ms a step + 1 ms a token
    assert c.threshold(1.0, rows=8) == pytest.approx(0.001 / (0.018 / 8))  # the profile's rate before any step
    for _ in range(50):
        c.observe_step(fed=8, emitted=16, seconds=0.018)  # half the fed tokens are drafts that land
    assert c.threshold(1.0, rows=8) == pytest.approx(0.001 / (0.018 / 16), rel=1e-6)
    compute_bound = AdaptiveController()
    compute_bound.cost.add_profile(8, 0.008)
    compute_bound.cost.add_profile(72, 0.072)  # every token costs the same: only sure drafts pay
    assert compute_bound.threshold(1.0, rows=8) == pytest.approx(1.0)
    free = AdaptiveController()
    free.cost.add_profile(8, 0.05)
    free.cost.add_profile(72, 0.05)  # a step costs the same whatever it carries: drafts are free
    assert free.threshold(1.0, rows=8) == MIN_PRICE


def test_the_proposers_host_work_stays_out_of_the_price():
    """A request's first ask indexes its old response, and observing a step indexes its tokens:
    host work per request, in bursts, that a fit of the step cost would take for the price of the
    step's draft tokens (and then draft nothing for the rest of the run)."""
    class Slow(Named):
        def propose(self, req, k):
            time.sleep(0.03)
            return Draft([7] * k, self)

    def fitted(step):
        c = AdaptiveController(max_draft_tokens=8)
        c.cost.add_profile(8, 0.018)
        c.cost.add_profile(72, 0.082)  # 10 ms a step + 1 ms a token
        for _ in range(3):
            c.observe_step(8, 8, 0.018, rows=8, policy=None)
        step(c)
        return c.token_cost(8)

    def burst_observed(c):
        c.observe_step(72, 80, 0.082 + 0.05, rows=8, drafted=64, observed=0.05)

    def burst_asked(c):
        start = time.perf_counter()
        c.choose(Request(0, [1], SP(), 0), 8, c.plan_step([Slow("x", prior=0.9)], 8, 1.0))
        c.observe_step(72, 80, 0.082 + time.perf_counter() - start, rows=8, drafted=64)

    def burst_unnamed(c):
        c.observe_step(72, 80, 0.082 + 0.05, rows=8, drafted=64)

    assert fitted(burst_observed) == pytest.approx(0.001, rel=0.05)
    assert fitted(burst_asked) == pytest.approx(0.001, rel=0.05)
    assert fitted(burst_unnamed) > 0.0015  # (what the burst would have done to the price)


def test_drafts_that_never_land_switch_off_and_exploration_turns_them_back_on():
    c = AdaptiveController(max_draft_tokens=8)
    c.cost.add_profile(8, 0.018)
    c.cost.add_profile(72, 0.082)
    p, req = Named("x", prior=0.5), Request(0, [1], SP(), 0)
    steps_on = 0
    for _ in range(30):
        on = c.plan_step([p], 8, 1.0).offers[0].most > 0
        steps_on += on
        if on:
            record(c, req, p, 0, proposed=2, accepted=0)
        c.observe_step(8, 8, 0.018)
    assert steps_on <= 5  # a few failed trials and the price is out of reach
    assert c.plan_step([p], 8, 1.0).offers[0].most == 0

    class Sure(Named):
        def propose(self, req, k):
            return Draft([7] * k, self)

    sure = Sure("x", prior=0.5)
    explored = 0
    for _ in range(2000):  # drafts land now: exploration finds out, and the rate climbs back
        d = c.choose(req, 8, c.plan_step([sure], 8, 1.0))
        if d is not None:
            explored += 1
            record(c, req, sure, 0, proposed=len(d.tokens), accepted=len(d.tokens))
        c.observe_step(8, 8, 0.018)
    assert explored > 0 and c.plan_step([sure], 8, 1.0).offers[0].most > 0


def test_only_steps_that_may_draft_earn_exploration():
    """A plain step (a probe, or every policy off) earns no exploration: while speculation is off
    its trials explore, and credit saved over plain steps would be spent in the next trial's first
    step, a token for every request."""
    c = AdaptiveController(max_draft_tokens=8)
    for _ in range(50):
        c.observe_step(8, 8, 0.02, rows=8, policy=None)
    assert c.credit == 0.0
    c.observe_step(8, 8, 0.02, rows=8, policy="budget")
    assert c.credit == pytest.approx(EXPLORE_FRACTION * 0.02)


def test_a_proposer_whose_asks_find_nothing_is_asked_for_few_requests_and_one_that_pays_for_all():
    class Counting(Named):
        def __init__(self, name, tokens):
            super().__init__(name, prior=0.9)
            self.tokens, self.asks = tokens, 0

        def propose(self, req, k):
            self.asks += 1
            return Draft(self.tokens[:k], self) if self.tokens else None

    def asks(c, proposers, chances=2000):
        req = Request(0, [1], SP(), 0)
        for _ in range(chances):
            c.choose(req, 4, c.plan_step(proposers, 8, 1.0))
        return [p.asks for p in proposers]

    priced = AdaptiveController(max_draft_tokens=4)
    priced.cost.add_profile(8, 0.05)
    priced.cost.add_profile(72, 0.05)  # drafts cost no step time: only the asks do
    empty, paying = Counting("empty", []), Counting("paying", [7, 7, 7, 7])
    n_paying, n_empty = asks(priced, [paying, empty])
    assert n_paying == 2000  # (its draft is the better one: the empty one is asked after it)
    assert MIN_ASKS + ASK_FLOOR * 1900 <= n_empty <= MIN_ASKS + ASK_FLOOR * 2000 + 1
    assert priced.ask_share("empty", 1.0) == ASK_FLOOR and priced.ask_share("paying", 1.0) == 1.0
    empty.tokens = [7, 7, 7, 7]  # its drafts start to pay (an epoch's second step: old responses exist)
    req = Request(0, [1], SP(), 0)
    for _ in range(16):  # at most 1/ASK_FLOOR chances to its next ask, which pays for all of them
        priced.choose(req, 4, priced.plan_step([empty], 8, 1.0))
    assert priced.ask_share("empty", 1.0) == 1.0
    idle = AdaptiveController(max_draft_tokens=4, asking={"x": [1000.0, 1.0, 0.0]})
    for _ in range(60):  # steps without asks: old tallies fade, so it is asked again
        idle.observe_step(8, 8, 0.05)
    assert idle.ask_share("x", 1.0) == 1.0
    fixed = AdaptiveController(min_draft_prob=0.1, max_draft_tokens=4)  # deterministic: never rationed
    assert asks(fixed, [Counting("empty", []), Counting("paying", [7, 7, 7, 7])]) == [2000, 2000]


def test_a_draft_token_is_also_worth_its_sample_as_lookahead_past_an_earlier_rejection():
    c = AdaptiveController(min_draft_prob=0.2)
    rates = [0.5] * 8
    assert c.cut(rates, 0.2) == (2, 0.75)  # 0.5, 0.25 reach 0.2; 0.125 does not
    n, value = c.cut(rates, 0.2, lookahead=[0.9 ** d for d in range(1, 9)])
    # token 2 (0-based): P = 0.125, plus the sample its row yields at position 3, 3 - j positions
    # past a first rejection at j <= 2: 0.5 x 0.9**3 + 0.25 x 0.9**2 + 0.125 x 0.9
    assert n == 8 and value == sum(0.5 ** i for i in range(1, 9))  # the value chooses proposers: direct only
    assert c.cut(rates, 0.2, lookahead=[0.1 ** d for d in range(1, 9)])[0] == 2  # rarely landing: adds little
    assert c.draft_len(0.5, 16, 0.2, lookahead=[0.9 ** d for d in range(1, 17)]) == 16
    # Samples that land in runs (a long shot first, then nearly sure): at threshold 0.25 token 2 is
    # worth 0.125 + 0.5 x 0.243 + 0.25 x 0.27 + 0.125 x 0.3 = 0.35 and token 4 0.24, where the
    # same first rate taken as geometric (0.3**d) gives token 2 0.125 + 0.0135 + 0.0225 + 0.0375 = 0.2
    runs = [0.3 * 0.9 ** (d - 1) for d in range(1, 9)]
    assert c.cut(rates, 0.25, lookahead=runs)[0] == 4
    assert c.cut(rates, 0.25, lookahead=[0.3 ** d for d in range(1, 9)])[0] == 2


def test_a_token_never_accepted_is_worth_its_row_when_the_sample_past_it_lands():
    # Feeding draft token 0 yields the sample at position 1: after the (sure) rejection of token 0
    # it is the lookahead's first token, which lands half the time (Jacobi-style decoding).
    assert AdaptiveController.cut([0.0, 0.0], 0.3, lookahead=[0.5, 0.4]) == (2, 0.0)
    assert AdaptiveController.cut([0.0, 0.0], 0.3, lookahead=[0.5, 0.1]) == (1, 0.0)
    assert AdaptiveController.cut([0.0], 0.6, lookahead=[0.5]) == (0, 0.0)


def test_later_tokens_of_a_draft_are_judged_and_learnt_with_the_agreement_before_them():
    c = AdaptiveController(min_draft_prob=0.05)
    req, p = Request(0, [1], SP(), 0), Named("x", prior=0.5)
    for _ in range(40):  # a first token that lands one time in four, then a run that nearly always does
        record(c, req, p, evidence=0, proposed=8, accepted=0)
        record(c, req, p, evidence=0, proposed=8, accepted=8)
        record(c, req, p, evidence=0, proposed=8, accepted=0)
        record(c, req, p, evidence=0, proposed=8, accepted=0)
    table = c.table(p)
    first, *later = rates_from(table, 0, None, 8)
    assert first < 0.3 and min(later) > 0.9
    assert rates_from(table, 3, None, 2) == [table[2][0], table[3][0]]  # evidence 3, then 4
    assert rates_from(table, 30, None, 4) == [table[5][0]] * 2 + [table[6][0]] * 2  # 30, 31; then the top level
    assert all(levels(e, n) == tuple(level(e + i) for i in range(n)) for e in range(-2, 70) for n in range(20))
    # one rate for the whole draft (first**i) would stop after a token; by levels it runs on
    assert c.cut(rates_from(table, 0, None, 8), 0.05)[0] == 8


def test_a_fixed_threshold_is_kept_and_bad_values_are_named():
    hf = tiny_hf_model()
    priced = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, spec=SpecConfig()))
    assert priced.controller.priced
    given = Engine.from_pretrained(hf, EngineConfig(max_batch_size=2, spec=SpecConfig(min_draft_prob=0.1)))
    assert given.controller.min_draft_prob == 0.1 and not given.controller.priced
    with pytest.raises(ValueError, match="min_draft_prob"):
        SpecConfig(min_draft_prob=1.5).validate()


def test_free_draft_tokens_are_taken_whatever_they_are_worth_when_priced():
    """A lone decode row runs its packed linear layers as two rows: the engine passes that row
    as `free`, and a priced budget fills it even with drafts that never land."""
    class Sometimes(Named):
        def propose(self, req, k):
            return Draft([7] * k, self)

    p, req = Sometimes("x", prior=0.5), Request(0, [1], SP(), 0)
    for fixed in (None, 0.3):
        c = AdaptiveController(min_draft_prob=fixed, max_draft_tokens=8)
        c.cost.add_profile(1, 0.010)
        c.cost.add_profile(9, 0.050)
        for _ in range(20):
            record(c, req, p, 0, proposed=2, accepted=0)  # never lands: out of the price's reach
        plan = c.plan_step([p], 1, 1.0)
        assert plan.offers[0].most == 0
        c.credit = 0.0  # no exploration
        assert c.choose(req, 8, plan) is None
        got = c.choose(req, 8, plan, free=1)
        assert (got is None) if fixed is not None else (got.tokens == [7])  # a fixed threshold stays deterministic
        assert c.choose(req, 0, plan, free=1) is None  # no room, no draft


def test_a_lone_request_fills_its_free_row_with_a_draft_and_keeps_its_tokens():
    """vocab 4096 x 48: the lm_head packs (rollout/linear.py), so a lone decode row computes two
    rows anyway and the priced budget drafts a token into the second one, landing or not."""
    hf = tiny_hf_model("llama", vocab=4096, seed=7)
    prompts, params = [[5, 6, 7] * 3], SamplingParams(temperature=1.0, max_tokens=30)
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=4, max_model_len=64))
    priced = Engine.from_pretrained(hf, EngineConfig(max_batch_size=4, max_model_len=64, spec=SpecConfig(
        proposers=("ngram",), max_draft_tokens=4)))
    assert priced.lone_row_free == 1
    small = Engine.from_pretrained(tiny_hf_model("llama", vocab=101), EngineConfig(max_batch_size=4, max_model_len=64))
    assert small.lone_row_free == 0  # MKL runs one row as one row: nothing is free
    ref = plain.generate(prompts, params, seeds=[3])

    class Wrong(Named):
        def propose(self, req, k):  # the token the engine will emit, plus one: never lands
            return Draft([(ref[0].token_ids[len(req.output_ids)] + 1) % 4096] * k, self)

    priced.proposers = [Wrong("wrong", prior=0.01)]
    out = priced.generate(prompts, params, seeds=[3])
    assert out[0].token_ids == ref[0].token_ids and out[0].logprobs == pytest.approx(ref[0].logprobs, abs=1e-5)
    assert out[0].stats["accepted"].get("wrong", 0) == 0
    # every speculating step's free row used, not left to exploration (the plain steps are timed:
    # rollout/plain_reference.py)
    speculating = priced.last_run.steps - priced.last_run.spec_off_steps
    assert speculating > 0 and out[0].stats["proposed"].get("wrong", 0) >= speculating - 2
