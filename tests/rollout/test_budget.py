"""The draft budget (rollout/budget/budget.py): the rule picks the lengths the cost table and the rates
call for, acceptance is learnt from counts, the step cost is measured once and cached, and the
same rollout drafts the same on an idle machine and beside a CPU burner."""
import itertools
import subprocess
import sys
import time

import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.budget import budget as B
from rollout.budget import step_cost
from rollout.proposers.base import Draft, Proposer
from tests.rollout.test_golden_replay import PROMPTS, peaked_model

CHEAP = {"tokens": [1, 16, 64, 512], "seconds": [0.010, 0.011, 0.020, 0.150]}  # memory-bound: flat to 16 tokens
DEAR = {"tokens": [1, 64, 512], "seconds": [0.001, 0.064, 0.512]}  # a fed token costs a decode


class Fixed(Proposer):
    """Drafts `tokens` (up to k) with the given prior."""

    def __init__(self, name="fixed", prior=0.7, tokens=tuple(range(3, 20)), position_s=0.0):
        self.name, self.prior, self.tokens, self.position_s = name, prior, list(tokens), position_s
        self.asked = []  # (requests, k) of each call

    def propose(self, requests, k):
        self.asked.append((list(requests), k))
        return [Draft(self.tokens[:k], self) if k > 0 and self.tokens else None for _ in requests]

    def position_cost(self, n):
        return self.position_s


def budget(cost=CHEAP, k=8, **kw):
    return B.Budget(max_draft_tokens=k, cost=step_cost.StepCost.from_dict(cost) if cost else None, **kw)


def lengths(b, proposer, batch, context=0):
    """The lengths the budget grants `batch` decoding requests that each get the proposer's draft."""
    plan = b.plan_step([proposer], batch, 1.0, context=context * batch)
    if plan is None:
        return None
    chosen = b.choose([None] * batch, [b.max_draft_tokens] * batch, plan)
    return b.allocate(plan, [c[1] if c else () for c in chosen], [context] * batch, spare=10 ** 6)


def test_deep_at_batch_one_where_fed_tokens_are_cheap_and_none_where_a_token_costs_a_decode():
    assert lengths(budget(CHEAP), Fixed(prior=0.7), 1) == [8]  # 0.7**8 = 0.06 still pays at nearly no cost
    assert lengths(budget(DEAR), Fixed(prior=0.7), 64) == [0] * 64
    assert lengths(budget(DEAR), Fixed(prior=0.7), 1) == [0]  # the next token costs what the step does
    assert lengths(budget(DEAR), Fixed(prior=0.999), 64) == [0] * 64  # a token short of sure costs more than it earns
    # the memory-bound table at batch 64: a fed token costs 0.13 / 448 s, a row's share 0.02 / 64 s,
    # so only tokens worth 0.93 pay; at 16, 0.009 / 48 s against 0.011 / 16 s: tokens worth 0.27 pay
    # (0.7, 0.49, 0.34) and the fourth (0.24) does not
    assert lengths(budget(CHEAP), Fixed(prior=0.7), 64) == [0] * 64
    assert lengths(budget(CHEAP), Fixed(prior=0.7), 16) == [3] * 16
    assert lengths(budget(CHEAP), Fixed(prior=0.95), 64) == [1] * 64
    assert lengths(budget(CHEAP, max_batch_for_spec=8), Fixed(prior=0.7), 9) is None


def test_the_greedy_rule_finds_the_best_lengths_on_a_convex_cost():
    """Against brute force over every pair of lengths: the most seconds saved, a landed token
    sparing its row a later step's share, less the seconds the drafts add to this one."""
    cost = step_cost.StepCost.from_dict({"tokens": [1, 3, 6, 12], "seconds": [1.0, 1.2, 2.0, 5.0], "per_row": 0.1})
    plan = B.StepPlan(B.MIN_VALUE, [], cost)
    row = B.share(cost, 2, 2, 0)
    assert row == pytest.approx(1.1 / 2 + 0.1)
    for a, b in itertools.product((0.3, 0.6, 0.9, 0.97), repeat=2):
        values = [[a ** i for i in range(1, 6)], [b ** i for i in range(1, 6)]]
        got = B.Budget().allocate(plan, values, [0, 0], spare=10)

        def saved(n, values=values):
            return row * (sum(values[0][:n[0]]) + sum(values[1][:n[1]])) - (cost.table(2 + sum(n)) - cost.table(2))

        best = max(itertools.product(range(6), repeat=2), key=saved)
        assert saved(got) == pytest.approx(saved(best)), (a, b, got, best)


def test_a_fixed_floor_drafts_every_token_worth_it_and_spare_tokens_bound_the_step():
    b = budget(cost=None, min_draft_prob=0.3)
    assert lengths(b, Fixed(prior=0.7), 2) == [3, 3]  # 0.7**3 = 0.34 >= 0.3 > 0.7**4
    plan = b.plan_step([Fixed(prior=0.7)], 2, 1.0)
    assert b.allocate(plan, [[0.9, 0.8], [0.85]], [0, 0], spare=2) == [1, 1]  # the likeliest first
    assert lengths(budget(cost=None, min_draft_prob=0.0), Fixed(prior=0.1), 1) == [8]


def test_a_proposer_with_a_position_cost_runs_the_positions_that_pay():
    cheap, dear = Fixed(position_s=1e-6), Fixed(position_s=0.5)
    assert budget(CHEAP).plan_step([cheap], 4, 1.0).offers[0].most == 8
    assert budget(CHEAP).plan_step([dear], 4, 1.0).offers[0].most == 0
    assert budget(cost=None, min_draft_prob=0.0).plan_step([dear], 4, 1.0).offers[0].most == 8  # unpriced


def test_a_proposer_with_a_cost_of_its_own_is_asked_on_its_rate_over_all_its_drafts():
    b = budget(CHEAP)
    free, dear = Fixed("free", prior=0.5), Fixed("dear", prior=0.5, position_s=1e-6)
    for p in (free, dear):  # one token in ten is confident and lands, the rest miss
        for i in range(200):
            b.learn(Draft([1], p, confidence=[0.999 if i % 10 == 0 else 0.1]), int(i % 10 == 0))
    free_offer, dear_offer = b.plan_step([free, dear], 16, 1.0).offers
    assert free_offer.top > 0.8 and free_offer.most > 0  # asking is free: its confident drafts may win
    assert dear_offer.top < 0.15 and dear_offer.most == 0  # each ask costs: 0.1 on average does not pay


def test_each_request_takes_the_proposer_with_the_longest_expected_run():
    b = budget(CHEAP)
    short_sure, long_unsure = Fixed("a", 0.95, tokens=[1, 2]), Fixed("b", 0.6, tokens=range(8))
    plan = b.plan_step([short_sure, long_unsure], 1, 1.0)
    ((draft, values),) = b.choose([None], [8], plan)
    assert draft.proposer is short_sure and values == pytest.approx([0.95, 0.95 ** 2])  # 1.85 > 0.6 / 0.4 x ...
    ((draft, _),) = b.choose([None], [8], b.plan_step([Fixed("a", 0.95, tokens=[1]), long_unsure], 1, 1.0))
    assert draft.proposer is long_unsure  # 0.95 < 0.6 + 0.36 + ...


def test_each_proposer_is_asked_once_per_step_for_the_requests_it_could_win():
    b = budget(cost=None, min_draft_prob=0.0)
    sure, unsure = Fixed("a", 0.99, tokens=range(8)), Fixed("b", 0.5, tokens=range(100, 108))
    plan = b.plan_step([sure, unsure], 3, 1.0)
    chosen = b.choose(["r0", "r1", "r2"], [8, 0, 3], plan)
    assert sure.asked == [(["r0", "r2"], 8)]  # r1 has no room; k: the most any of them may take
    assert unsure.asked == []  # its best rate could not beat the sure drafts in hand
    assert [c and c[0].tokens for c in chosen] == [list(range(8)), None, [0, 1, 2]]  # cut to each one's room


def test_acceptance_is_learnt_per_level_and_confidence_bin_from_counts():
    b, p = budget(), Fixed(prior=0.5)
    b.learn(Draft([1, 2, 3, 4], p, evidence=1, confidence=[0.995, 0.4, 0.995, 0.4]), accepted=2)
    # compared: tokens 0, 1 (accepted) and 2 (the first mismatch), at levels of evidence 1, 2, 3
    assert (b.accepted["fixed"], b.trials["fixed"]) == (2, 3)
    assert [(b.accepted[("fixed", lv)], b.trials[("fixed", lv)]) for lv in (1, 2)] == [(1, 1), (1, 2)]
    assert b.trials[("fixed", 1, B.confidence_bin(0.995))] == 1 and ("fixed", 3) not in b.trials
    table = b.table(p)
    assert table[2][B.confidence_bin(0.4)] > table[2][B.confidence_bin(0.995)]  # lv 2's 0.4-token landed
    b.learn(Draft([1, 2], p), accepted=1, judged=1)  # the request ended after the first token
    assert b.trials["fixed"] == 4
    b.new_run()
    assert b.trials["fixed"] == 4 * B.RUN_DECAY
    again = budget()
    again.load_state_dict(b.state_dict())
    assert again.table(p) == b.table(p)
    fresh = budget().table(Fixed(prior=0.8))
    assert fresh[0][0] == pytest.approx(0.8) and fresh[6][5] == pytest.approx(0.8)  # the prior, everywhere


def test_misses_of_short_matches_leave_long_matches_their_prior():
    """A level never compared keeps the proposer's prior: a suffix proposer whose first drafts,
    matched on a token or two, all miss is still asked where it matches long, and learns there."""
    b, p = budget(CHEAP), Fixed(prior=0.5)
    for _ in range(40):
        b.learn(Draft([1], p, evidence=1), accepted=0)
    table = b.table(p)
    assert table[B.level(1)][0] < 0.1 and table[B.level(40)][0] == pytest.approx(0.5)
    plan = b.plan_step([p], 1, 1.0)
    assert plan.offers[0].top == pytest.approx(0.5) and plan.offers[0].most > 0
    short, = b.choose([None], [8], plan)  # Fixed drafts at evidence 0: level 0 has no trials either
    assert short is not None
    b.learn(Draft([1] * 8, p, evidence=40), accepted=8, judged=8)
    assert b.table(p)[B.level(40)][0] > 0.8  # what it shows where it is asked is learnt there


def test_a_draft_token_pays_the_attention_its_row_has_not_already_paid():
    """Draft tokens read the keys and values their row's first token loads: with the attention
    all on the first token, a long context makes a plain step dearer and its drafts no dearer, so
    they go deeper than over no context; charged to every token, they go shallower."""
    first_only = dict(CHEAP, per_attended=2e-5, per_attended_draft=0.0)
    every = dict(CHEAP, per_attended=2e-5)  # no per_attended_draft: each token pays the first's
    assert step_cost.StepCost.from_dict(every).draft_attended == 2e-5
    none = lengths(budget(CHEAP), Fixed(prior=0.7), 16)
    deep = lengths(budget(first_only), Fixed(prior=0.7), 16, context=400)
    shallow = lengths(budget(every), Fixed(prior=0.7), 16, context=400)
    assert none == [3] * 16 and min(deep) > 3 and sum(shallow) < sum(deep)


def test_the_profile_recovers_the_attention_of_first_and_draft_tokens():
    def time_forward(fed, cached, rows=None):  # 1 ms + 0.1 ms a token; 2 us per context token of a
        rows = rows or fed  # row's first token, 0.5 us of a further one
        return 1e-3 + 1e-4 * fed + cached * (2e-6 * rows + 5e-7 * (fed - rows))
    d = step_cost.profile(time_forward, [1, 8, 64], rows=8, context=100, depth=9, time_host=lambda: 3e-5)
    assert d["per_attended"] == pytest.approx(2e-6) and d["per_attended_draft"] == pytest.approx(5e-7)
    assert step_cost.StepCost.from_dict(d).table(8) == pytest.approx(1.8e-3) and d["per_row"] == 3e-5
    assert step_cost.profile(time_forward, [1, 8], rows=8, context=0, depth=9)["per_row"] == 0.0


def test_host_work_per_row_makes_each_row_s_share_dearer_so_drafts_go_deeper():
    """A tiny model's step is mostly the engine's own work per row: a token that spares its row a
    step spares that work too, so tokens worth less pay."""
    host = dict(CHEAP, per_row=1e-3)
    assert B.share(step_cost.StepCost.from_dict(host), 16, 16, 0) == pytest.approx(0.011 / 16 + 1e-3)
    assert lengths(budget(CHEAP), Fixed(prior=0.7), 64) == [0] * 64
    # a row's share at 64 is 1.31 ms, a fed token 0.29 ms: 0.7 ** 4 = 0.24 pays, 0.7 ** 5 = 0.17 does not
    assert lengths(budget(host), Fixed(prior=0.7), 64) == [4] * 64
    assert lengths(budget(host), Fixed(prior=0.7), 16) == [4] * 16  # past 64 fed, 0.29 ms a token again


def test_a_bad_step_cost_is_refused_with_its_field():
    for bad in ({"tokens": [4, 2], "seconds": [1, 2]}, {"tokens": [1], "seconds": [-1]}, {"seconds": [1]}, [1, 2],
                {"tokens": [1], "seconds": [1], "per_attended_draft": -1e-6},
                {"tokens": [1], "seconds": [1], "per_row": -1}):
        with pytest.raises(ValueError, match="step_cost"):
            SpecConfig(step_cost=bad).validate()
    # noise: a forward is never cheaper for feeding more, and a timing only ever errs slow (a cold
    # cache on the first): the point above a larger forward's comes down to it
    cost = step_cost.StepCost.from_dict({"tokens": [1, 4, 8], "seconds": [1.0, 0.5, 3.0]})
    assert cost.seconds == (0.5, 0.5, 3.0) and cost.table(12) == pytest.approx(5.5)


# ---- the engine --------------------------------------------------------------------------------


def rollout(engine):
    """Per step, the draft lengths granted; the run's steps; each request's proposed counts."""
    granted, allocate = [], engine.budget.allocate
    engine.budget.allocate = lambda *a, **kw: granted.append(allocate(*a, **kw)) or granted[-1]
    ids = [p for p in PROMPTS for _ in range(4)]
    outs = engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=[0]),
                           seeds=list(range(len(ids))), groups=[i // 4 for i in range(len(ids))])
    return granted, engine.last_run.steps, [o.stats["proposed"] for o in outs], [o.token_ids for o in outs]


def spec_engine(hf, **spec):
    return Engine.from_pretrained(hf, EngineConfig(max_batch_size=6, max_model_len=64, dtype="float64", num_threads=1,
                                                   spec=SpecConfig(proposers=("suffix", "lookahead", "ngram"), **spec)))


def test_the_step_cost_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTAIL_CACHE", str(tmp_path))
    hf = peaked_model()
    first = spec_engine(hf)
    first.generate([[5, 6, 7]], SamplingParams(max_tokens=4), seeds=[1])
    (path,) = (tmp_path / "step_cost").iterdir()
    assert first.budget.cost.per_row > 0  # the engine's own work per row, measured with the forwards
    monkeypatch.setattr(Engine, "_time_forward", lambda *a: pytest.fail("profiled again"))
    monkeypatch.setattr(Engine, "_time_host", lambda *a: pytest.fail("profiled again"))
    second = spec_engine(hf)
    second.generate([[5, 6, 7]], SamplingParams(max_tokens=4), seeds=[1])
    assert second.budget.cost == first.budget.cost and second.budget.cost.seconds[-1] > 0
    given = spec_engine(hf, step_cost=CHEAP)  # from the config: neither measured nor cached
    given.generate([[5, 6, 7]], SamplingParams(max_tokens=4), seeds=[1])
    assert given.budget.cost == step_cost.StepCost.from_dict(CHEAP)
    assert len(list((tmp_path / "step_cost").iterdir())) == 1


def test_the_same_rollout_drafts_the_same_beside_a_cpu_burner(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTAIL_CACHE", str(tmp_path))
    hf = peaked_model()
    quiet = rollout(spec_engine(hf))  # measures the step cost and caches it
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        loaded = rollout(spec_engine(hf))
    finally:
        burner.kill()
        burner.wait()
    assert loaded == quiet
    granted = [n for step in quiet[0] for n in step]
    assert sum(granted) > 0 and 0 in granted  # it drafted, and not everything
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=6, max_model_len=64, dtype="float64"))
    ids = [p for p in PROMPTS for _ in range(4)]
    ref = plain.generate(ids, SamplingParams(temperature=1.0, max_tokens=40, stop_token_ids=[0]),
                         seeds=list(range(len(ids))))
    assert quiet[3] == [o.token_ids for o in ref]
