"""Plain steps are timed now and then, and speculation is switched off while its steps lose to them."""
import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.config import SamplingParams as SP
from rollout.controller import AdaptiveController
from rollout.plain_reference import (
    BURSTY_TRIAL,
    EAGER_EDGE,
    EAGER_START,
    EARLY_PROBE_EVERY,
    FIRST_PROBES,
    MAX_SHORTER,
    MIN_OFF,
    PROBE_EVERY,
    PROBE_MAX_FEED,
    SHORT_TRIAL,
    TRIAL,
    PlainReference,
)
from rollout.proposers.base import Draft, Proposer
from rollout.request import Request
from tests.conftest import tiny_hf_model

ROWS = 8
PLAIN_STEP = 0.010  # seconds a plain step of ROWS decoding requests takes in these tests


def plain_step(ref: PlainReference) -> None:
    ref.observe(None, ROWS, 0, ROWS, ROWS, PLAIN_STEP)


def spec_step(ref: PlainReference, emitted: int, seconds: float = 2 * PLAIN_STEP, policy: str = "budget") -> None:
    """A speculating step of ROWS requests that fed 3 drafts each."""
    ref.observe(policy, 4 * ROWS, 3 * ROWS, ROWS, emitted, seconds)


def budget(ref: PlainReference):
    """The budget's ledger (the only policy that drafts where a step drafting in full is dear)."""
    return ref.ledgers["budget"]


def steps_until_probe(ref: PlainReference, emitted: int, drafts: bool = True) -> int:
    """Speculating steps that feed 3 drafts a request (or none) until a probe."""
    n = 0
    while ref.choose():
        drafted = 3 * ROWS if drafts else 0
        ref.observe("budget", ROWS + drafted, drafted, ROWS, emitted, 2 * PLAIN_STEP)
        n += 1
        assert n <= 2 * PROBE_EVERY
    return n


def speculate(ref: PlainReference, emitted: int, most: int) -> int:
    """Speculating steps (and the probes due among them) until speculation is switched off, at most
    `most` of them; returns how many ran."""
    n = 0
    while n < most and budget(ref).off_left == 0:
        if ref.choose():
            spec_step(ref, emitted)
            n += 1
        else:
            plain_step(ref)  # a probe
    return n


def test_a_run_starts_with_a_probe_and_probes_thin_out_once_the_plain_cost_is_known():
    ref = PlainReference()
    ref.new_run(0.5)
    assert ref.choose() is None and not ref.measured
    plain_step(ref)
    assert ref.measured and ref.seconds_per_emitted(ROWS) == pytest.approx(PLAIN_STEP / ROWS)
    gaps = []
    for _ in range(FIRST_PROBES + 1):
        gaps.append(steps_until_probe(ref, emitted=4 * ROWS))  # drafts that pay: never switched off
        plain_step(ref)
    assert gaps[:FIRST_PROBES - 1] == [EARLY_PROBE_EVERY] * (FIRST_PROBES - 1) and gaps[-1] == PROBE_EVERY
    # between steps that draft nothing a probe costs about nothing (no chain of drafts to cut)
    assert steps_until_probe(ref, emitted=4 * ROWS, drafts=False) == EARLY_PROBE_EVERY
    # twice the time for four times the tokens
    assert budget(ref).off_left == 0 and budget(ref).ratio == pytest.approx(0.5)


def test_a_plain_step_mostly_of_prompt_tokens_is_not_a_probe():
    """A run's first step feeds whole prompts: per token it is cheaper than decoding and pays the
    run's one-time costs, so as the only probe it put the plain line's fixed cost far above a
    decoding step's, and drafting steps that cost as much as plain ones read as gains."""
    ref = PlainReference()
    ref.new_run(0.5)
    prompt_tokens = 8 * ROWS
    ref.observe(None, prompt_tokens, 0, ROWS, ROWS, 3 * PLAIN_STEP)  # every request's prompt, then its first token
    assert not ref.measured and ref.choose() is None  # still due: the next plain step is the probe
    ref.observe(None, PROBE_MAX_FEED * ROWS, 0, ROWS, ROWS, PLAIN_STEP)  # a new prompt among decoding rows: a probe
    assert ref.measured and ref.seconds_per_emitted(ROWS) == pytest.approx(PLAIN_STEP / ROWS)
    assert speculate(ref, ROWS + ROWS // 2, 4 * TRIAL) == TRIAL  # twice a plain step's time for 1.5 steps' tokens
    # once a decoding step was timed, a due probe that feeds prompts is the probe all the same
    # (not fitted): with requests admitted every few steps, a probe kept due would make every
    # step plain until one fed no prompt
    while budget(ref).off_left:
        plain_step(ref)
    steps_until_probe(ref, emitted=4 * ROWS)
    fit = ref.cost.fit()
    ref.observe(None, prompt_tokens, 0, ROWS, ROWS, 3 * PLAIN_STEP)
    assert ref.choose() == "budget" and ref.cost.fit() == fit


def test_steps_that_lose_to_plain_switch_speculation_off_for_a_wait_that_doubles():
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    assert speculate(ref, ROWS + 1, 100) == TRIAL  # twice the time for one more token: judged after a trial
    assert budget(ref).off_left == MIN_OFF
    for _ in range(MIN_OFF):
        assert ref.choose() is None
        plain_step(ref)
    assert ref.choose() == "budget"  # a trial again, a short one: the last lost, and so does the record
    assert speculate(ref, ROWS + 1, 100) == SHORT_TRIAL and budget(ref).off_left == 2 * MIN_OFF

    ref.new_run(0.5)  # a new run tries at once (after its probe); the wait it earned is kept
    assert budget(ref).off_left == 0 and budget(ref).wait == 4 * MIN_OFF
    plain_step(ref)
    assert speculate(ref, 4 * ROWS, TRIAL) == TRIAL  # drafts land now
    assert budget(ref).off_left == 0 and budget(ref).wait == MIN_OFF  # a winning trial: the next loss waits the least


def test_a_run_that_brings_a_new_draft_source_judges_every_policy_afresh():
    """An epoch's first run has no history; the waits its losses earned were earned without it,
    and a first short trial of the next run (where the old responses are not yet aligned) would
    otherwise keep a whole epoch of history drafts waiting. Its first trial is a long one, once."""
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    for _ in range(3):  # losses with the siblings alone: the wait grows, the trial shortens
        speculate(ref, ROWS + 1, 100)
        while budget(ref).off_left:
            plain_step(ref)
    assert budget(ref).wait == 8 * MIN_OFF and budget(ref).lost
    ref.new_run(0.5, frozenset({"history"}))
    assert budget(ref).wait == MIN_OFF and not budget(ref).lost
    plain_step(ref)
    assert speculate(ref, ROWS + 1, 100) == BURSTY_TRIAL  # a long trial ...
    assert budget(ref).off_left == MIN_OFF  # ... and the least wait
    while budget(ref).off_left:
        plain_step(ref)
    speculate(ref, ROWS + 1, 100)
    ref.new_run(0.5, frozenset({"history"}))  # history again: nothing new, the wait it earned is kept
    assert budget(ref).wait == 4 * MIN_OFF and budget(ref).lost
    state = ref.state_dict()
    again = PlainReference()
    again.load_state_dict(state)  # a resumed engine knows what the last run brought
    assert again.sources == frozenset({"history"})


def test_a_verdict_holds_for_its_load_and_a_run_tail_is_judged_again():
    """Losses at a full batch switch a policy off for a wait that can outlast the run; once as few
    as half the requests run (the tail, where a step costs about the same with or without its
    drafts) it is tried again."""
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    assert speculate(ref, ROWS + 1, 100) == TRIAL and budget(ref).off_left == MIN_OFF  # lost at ROWS requests
    assert ref.choose(running=ROWS) is None and ref.choose(running=ROWS // 2 + 1) is None
    assert budget(ref).off_left == MIN_OFF  # (above half the load the wait holds)
    assert ref.choose(running=ROWS // 2) == "budget" and budget(ref).off_left == 0  # at half: a trial at once
    assert ref.choose() == "budget"  # (a caller that gives no load changes nothing)


def test_wins_in_a_run_tail_do_not_excuse_losses_at_a_full_batch():
    """A record that wins lets a losing stretch wait the least; wins at a few requests (a run's
    tail, where drafts cost a step little) say nothing of a full batch, where the wait grows."""
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    for _ in range(40):  # two requests left, each emitting 4 tokens a step at twice a plain step's time
        ref.observe("budget", 2 * 4, 2 * 3, 2, 2 * 4, 2 * PLAIN_STEP)
    assert budget(ref).winning and budget(ref).winning_at(2)
    trials = []
    for _ in range(2):  # a full batch: twice the time for one more token, in two trials
        trials.append(speculate(ref, ROWS + 1, 100))
        while budget(ref).off_left:
            plain_step(ref)
    assert budget(ref).winning and not budget(ref).winning_at(ROWS)
    # as where no record wins: the second trial is a short one, and its loss doubles the wait
    assert trials[1] == SHORT_TRIAL and budget(ref).wait == 2 * MIN_OFF
    restored = PlainReference()
    restored.load_state_dict(ref.state_dict())
    assert budget(restored).loads == budget(ref).loads


def test_slight_losses_double_the_wait_once_a_second_trial_confirms_them():
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    slight = round(2 * ROWS / 1.1)  # about 1.1x the plain time: under CLEAR_LOSS
    waits = []
    for trial in (TRIAL, SHORT_TRIAL, SHORT_TRIAL, SHORT_TRIAL):
        assert speculate(ref, slight, 100) == trial
        waits.append(budget(ref).off_left)
        for _ in range(budget(ref).off_left):
            plain_step(ref)
    assert waits == [MIN_OFF, MIN_OFF, 2 * MIN_OFF, 4 * MIN_OFF]  # the first may be noise; the next are not
    restored = PlainReference()
    restored.load_state_dict(ref.state_dict())
    assert budget(restored).lost and budget(restored).wait == budget(ref).wait
    # drafts land: back to the shortest wait
    assert speculate(ref, 4 * ROWS, TRIAL) == TRIAL and budget(ref).off_left == 0
    assert not budget(ref).lost and budget(ref).wait == MIN_OFF


def test_the_plain_cost_is_fitted_against_the_tokens_a_step_feeds():
    ref = PlainReference()
    for n in (8, 64, 8, 64):
        ref.observe(None, n, 0, n, n, 0.002 + n * 0.0001)
    assert ref.seconds_per_emitted(16) == pytest.approx((0.002 + 16 * 0.0001) / 16)
    # a step with a prompt chunk of 56 tokens besides 8 decoding rows: plain would feed those too,
    # once: its 32 tokens take 4 plain steps, the first with the chunk, three of 8 rows
    ref.observe("budget", 8 + 56 + 24, 24, 8, 32, 0.002 + 88 * 0.0001)
    w, spent, plain = budget(ref).sums
    assert plain == pytest.approx((0.002 + 64 * 0.0001) + 3 * (0.002 + 8 * 0.0001))


def test_a_priced_controller_values_an_accepted_token_at_what_a_plain_step_spends_per_token():
    c = AdaptiveController()
    c.add_profile(8, 0.018)
    c.add_profile(72, 0.082)
    assert c.policy(8) == "budget"  # nothing says it loses yet
    before = c.seconds_per_emitted(8)
    for _ in range(3):
        c.observe_step(8, 8, 0.004, rows=8, policy=None)  # plain steps, timed: cheaper than the profile says
    assert c.seconds_per_emitted(8) < before
    assert c.seconds_per_emitted(8) == pytest.approx(c.plain.cost.predict(8) / 8)
    assert AdaptiveController(min_draft_prob=0.2).policy(8) == "budget"  # a fixed threshold never probes


class Wrong(Proposer):
    """Drafts the token after the one the engine will emit: never lands."""
    name, prior = "wrong", 0.99

    def __init__(self, ref):
        self.ref = ref

    def propose(self, req, k):
        out = self.ref[req.index]
        t = len(req.output_ids)
        return Draft([(out[t] + 1) % 211 if t < len(out) else 3] * k, self, evidence=64)


class FakeClock:
    """Steps cost what `cost(step)` says, whatever the machine does: compute-bound (a fed token
    costs as much as a step's fixed part) and a speculating step pays `planned` seconds of host
    work more, which no draft token is charged (the price cannot see it)."""

    def __init__(self, planned: float):
        self.now, self.planned = 0.0, planned

    def perf_counter(self) -> float:
        return self.now

    def cost(self, done) -> float:
        return 0.001 + 0.001 * done.fed + (self.planned if done.policy is not None else 0.0)


@pytest.mark.parametrize("planned", [0.0, 0.005])
def test_an_engine_whose_drafts_never_land_runs_about_as_long_as_plain_and_keeps_its_tokens(monkeypatch, planned):
    """planned 0: the price alone switches drafting off; 0.005: every speculating step loses host
    time the price does not see, and the plain steps' ledger switches speculation off."""
    hf = tiny_hf_model("llama", vocab=211, seed=33)
    prompts = [[i, i + 1, i + 2] for i in range(1, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=120)
    plain = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=160))
    ref = plain.generate(prompts, params, seeds=list(range(8)))
    clock = FakeClock(planned)
    step = Engine._step

    def timed_step(self, running):
        done = step(self, running)
        clock.now += clock.cost(done)
        return done

    monkeypatch.setattr(Engine, "_step", timed_step)
    monkeypatch.setattr("rollout.engine.time", clock)
    monkeypatch.setattr("rollout.controller.time", clock)
    monkeypatch.setattr(Engine, "_profile", lambda self: [self.controller.add_profile(n, 0.001 + 0.001 * n)
                                                          for n in (8, 72)])
    clock.now = 0.0
    plain.generate(prompts, params, seeds=list(range(8)))
    plain_seconds = clock.now
    priced = Engine.from_pretrained(hf, EngineConfig(max_batch_size=8, max_model_len=160, spec=SpecConfig(
        proposers=("ngram",), max_draft_tokens=6)))
    priced.proposers = [Wrong({i: o.token_ids for i, o in enumerate(ref)})]
    for _ in range(2):  # the first run learns what the drafts are worth; the second shows it
        start = clock.now
        out = priced.generate(prompts, params, seeds=list(range(8)))
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.stats["accepted"].get("wrong", 0) for o in out) == 0
    assert clock.now - start <= 1.05 * plain_seconds, (clock.now - start, plain_seconds, priced.last_run)
    if planned:
        assert priced.last_run.spec_off_steps > priced.last_run.steps / 2, priced.last_run


def run_policies(ref: PlainReference, emitted_by: dict, steps: int, eager_ok: bool = True) -> list:
    """A run of `steps` steps as `choose` picks them, a speculating step by policy p emitting
    emitted_by[p] tokens in twice a plain step's time; returns each step's policy (None: plain)."""
    ref.new_run(0.5)
    ran = []
    for _ in range(steps):
        policy = ref.choose(eager_ok)
        if policy is None:
            plain_step(ref)
        else:
            spec_step(ref, emitted_by[policy], policy=policy)
        ran.append(policy)
    return ran


def preferred(emitted_by: dict, runs: int, steps: int = 40) -> list:
    """The policy that drafted most in each of `runs` runs."""
    ref, out = PlainReference(), []
    for _ in range(runs):
        ran = [p for p in run_policies(ref, emitted_by, steps) if p]
        out.append(max(set(ran), key=ran.count))
    return out


def test_where_drafting_in_full_is_cheap_each_run_prefers_the_policy_with_the_better_record():
    # eager better: after one run of each, eager drafts, and the budget gets one run in five
    assert preferred({"budget": 3 * ROWS, "eager": 4 * ROWS}, 12) == \
        ["budget", "eager", "eager", "eager", "eager", "budget"] + ["eager"] * 4 + ["budget", "eager"]
    # the budget clearly better: it drafts, and eager gets one run in five
    assert preferred({"budget": 4 * ROWS, "eager": 3 * ROWS}, 8) == \
        ["budget", "eager", "budget", "budget", "budget", "budget", "eager", "budget"]
    # the budget better by less than EAGER_EDGE: eager drafts (the budget's record may ride on eager's lookahead)
    slight = round(4 * ROWS * (1 + EAGER_EDGE / 2))
    assert preferred({"budget": slight, "eager": 4 * ROWS}, 4) == ["budget", "eager", "eager", "eager"]


def test_eager_drafts_only_where_a_step_drafting_in_full_is_cheap():
    ref = PlainReference()
    for _ in range(3):
        run_policies(ref, {"budget": 3 * ROWS, "eager": 4 * ROWS}, 40)
    assert ref.preferred == "eager"
    ran = run_policies(ref, {"budget": 3 * ROWS}, 40, eager_ok=False)  # steps got dear: the budget drafts
    assert "eager" not in ran and ran.count("budget") >= 40 - 40 // EARLY_PROBE_EVERY - 1


def test_a_policy_that_loses_to_plain_is_switched_off_on_its_own_and_the_other_drafts_meanwhile():
    ref = PlainReference()
    run_policies(ref, {"budget": 4 * ROWS, "eager": 4 * ROWS}, 40)  # the first run: the budget
    ran = run_policies(ref, {"budget": 4 * ROWS, "eager": ROWS + 1}, 200)  # eager's run; it loses (ratio about 2)
    eager = ref.ledgers["eager"]
    assert eager.lost and not ref.ledgers["budget"].lost
    # judged after BURSTY_TRIAL steps, then tried again after waits that double (16, 32, 64 steps)
    assert 3 * BURSTY_TRIAL < ran.count("eager") < 4 * BURSTY_TRIAL and eager.wait == 8 * MIN_OFF
    assert ran.count(None) <= 200 // EARLY_PROBE_EVERY  # probes only: the budget drafts meanwhile
    assert ref.preferred == "eager" and run_policies(ref, {"budget": 4 * ROWS}, 40).count("eager") == 0
    restored = PlainReference()
    restored.load_state_dict(ref.state_dict())
    assert restored.preferred == ref.preferred and restored.kept == ref.kept
    idle = {"off_left": 0, "off_rows": 0}  # (a run starts with every wait over)
    assert {p: vars(x) | idle for p, x in restored.ledgers.items()} == \
        {p: vars(x) | idle for p, x in ref.ledgers.items()}


def test_eager_halves_its_draft_length_as_it_loses_and_tries_it_longer_once_its_record_wins():
    ref = PlainReference()
    assert ref.eager_length(16) == 16 >> EAGER_START  # (no run has judged it: it starts short)
    run_policies(ref, {"budget": 4 * ROWS, "eager": 4 * ROWS}, 40)  # the first run: the budget
    run_policies(ref, {"budget": 4 * ROWS, "eager": ROWS + 1}, 200)  # eager loses trial after trial
    eager = ref.ledgers["eager"]
    assert eager.shorter == MAX_SHORTER and ref.eager_length(16) == 2 and ref.eager_length(3) == 2
    assert ref.ledgers["budget"].shorter == 0  # (the budget's drafts are cut by the price, not a length)
    lengths = []
    for _ in range(12):  # eager wins now: each run that starts with its record winning doubles it back
        run_policies(ref, {"budget": 4 * ROWS, "eager": 6 * ROWS}, 40)
        lengths.append(ref.eager_length(16))
    assert lengths[-1] == 16 and lengths == sorted(lengths)


def test_while_the_preferred_policy_is_off_the_other_stands_in_only_if_its_record_wins():
    ref = PlainReference()
    run_policies(ref, {"budget": ROWS + 1, "eager": 4 * ROWS}, 60)  # the budget's run: it loses
    assert ref.ledgers["budget"].score > 1
    run_policies(ref, {"budget": ROWS + 1, "eager": 4 * ROWS}, 60)  # eager's run: it wins
    assert ref.preferred == "eager"
    ran = run_policies(ref, {"budget": ROWS + 1, "eager": ROWS + 1}, 200)  # eager's drafts stop landing
    first_off = ran.index(None, 1)
    assert ref.ledgers["eager"].lost and "budget" not in ran[first_off:]  # plain while eager is off
    # where eager may not run, the budget drafts whatever its record (its own trials judge it)
    assert run_policies(ref, {"budget": 4 * ROWS}, 40, eager_ok=False).count("budget") > 30


def test_eager_rides_out_a_losing_stretch_while_its_record_wins_and_not_for_ever():
    ref = PlainReference()
    for _ in range(3):
        run_policies(ref, {"budget": 3 * ROWS, "eager": 4 * ROWS}, 60)
    assert ref.preferred == "eager" and ref.ledgers["eager"].score == pytest.approx(0.5)
    ran = run_policies(ref, {"budget": 3 * ROWS, "eager": ROWS + 1}, 200)  # its drafts stop landing
    first = next(i for i, p in enumerate(ran) if p == "budget")  # eager switched off here
    assert ran[first - 1] == "eager" and ran[1:first].count("eager") > 2 * BURSTY_TRIAL
    assert ref.ledgers["eager"].score > 1 and ref.ledgers["eager"].lost


def test_a_checkpoint_of_before_eager_loads_into_the_budget_ledger():
    old = {"cost": PlainReference().cost.state_dict(), "probes": 2.0, "ledger": [1.0, 2.0, 3.0], "wait": 64,
           "lost": True}
    ref = PlainReference()
    ref.load_state_dict(old)
    assert ref.ledgers["budget"].sums == [1.0, 2.0, 3.0] and ref.ledgers["budget"].wait == 64
    assert ref.ledgers["eager"].score is None and ref.probes == 2.0
    assert ref.eager_length(16) == PlainReference().eager_length(16)  # eager starts as a fresh one does


def test_eager_is_offered_only_where_drafting_in_full_costs_little_more_than_a_plain_step(monkeypatch):
    class Offers(Proposer):
        name, prior = "x", 0.05

        def propose(self, req, k):
            return Draft([7] * k, self)

    seen = []
    for fed_cost, cheap in ((0.0001, True), (0.001, False)):  # per fed token, against 0.01 a step
        c = AdaptiveController(max_draft_tokens=8)
        c.add_profile(8, 0.010 + 8 * fed_cost)
        c.add_profile(72, 0.010 + 72 * fed_cost)
        # gated at the longest draft, however short eager's own drafts are now (3 tokens a row would pass)
        c.plain.ledgers["eager"].shorter = MAX_SHORTER
        monkeypatch.setattr(c.plain, "choose",
                            lambda eager_ok, running=0: seen.append(eager_ok) or ("eager" if eager_ok else "budget"))
        plan = c.plan_step([Offers()], 8, 1.0)
        assert seen[-1] is cheap  # 8 rows of 9 tokens: 1.6x a plain step's cost, or 4.6x
        assert plan.policy == ("eager" if cheap else "budget")
        if cheap:  # every token a proposer offers, however unlikely, up to eager's length
            assert plan.threshold == 0.0 and plan.offers[0].most == c.plain.eager_length(8) == 2
            assert c.choose(Request(0, [1], SP(), 0), 8, plan).tokens == [7] * 2
        else:
            assert plan.offers[0].most < 8


def test_a_record_made_standing_in_ranks_no_policy_until_a_run_prefers_it():
    ref = PlainReference()
    # the budget's run: it loses and is switched off; eager stands in for the rest, and loses too
    ran = run_policies(ref, {"budget": ROWS + 1, "eager": ROWS + 1}, 60)
    assert ran.count("eager") > 0 and ref.ledgers["eager"].record_ratio > 1
    assert ref.ledgers["eager"].score is None  # the steps the budget left it need not be like the rest
    run_policies(ref, {"budget": ROWS + 1, "eager": 4 * ROWS}, 60)
    assert ref.preferred == "eager" and ref.ledgers["eager"].score < 1


def test_while_its_record_wins_a_losing_stretch_waits_the_least_and_the_wait_does_not_grow():
    ref = PlainReference()
    run_policies(ref, {"budget": 4 * ROWS}, 60, eager_ok=False)  # a record that wins
    assert budget(ref).score < 1
    ref.new_run(0.5)
    plain_step(ref)
    for _ in range(3):  # stretches that lose clearly (the machine, say): each waits the least
        assert speculate(ref, ROWS + 1, 100) == TRIAL
        assert budget(ref).off_left == MIN_OFF and budget(ref).wait == MIN_OFF
        for _ in range(MIN_OFF):
            plain_step(ref)
    # and once the losses outweigh the record, the wait doubles again
    while budget(ref).winning:
        speculate(ref, ROWS + 1, 100)
        assert budget(ref).off_left == MIN_OFF
        for _ in range(MIN_OFF):
            plain_step(ref)
    assert budget(ref).wait == 2 * MIN_OFF
    speculate(ref, ROWS + 1, 100)
    assert budget(ref).off_left == 2 * MIN_OFF and budget(ref).wait == 4 * MIN_OFF


def test_steps_whose_drafts_all_missed_never_read_as_gains_whatever_the_fit_says():
    ref = PlainReference()
    ref.new_run(0.5)
    ref.observe(None, ROWS, 0, ROWS, ROWS, 2 * PLAIN_STEP)  # a probe while the machine was slow
    assert ref.choose() == "budget"
    for _ in range(TRIAL):  # the machine is fast again; drafts fed, none landed: no better than plain
        ref.observe("budget", 4 * ROWS, 3 * ROWS, ROWS, ROWS, 1.05 * PLAIN_STEP)
    assert budget(ref).off_left == MIN_OFF  # (even, at best: off)


def test_a_bursty_policy_whose_record_lost_is_judged_on_a_trial_like_any_other():
    ref = PlainReference()
    losing = {"budget": ROWS, "eager": ROWS + 1}  # both lose; eager by less
    run_policies(ref, losing, 100)  # the budget's run
    stretches = []
    for _ in range(2):  # eager's runs: the first after no record, the second after one that lost
        ran = run_policies(ref, losing, 100)
        assert ref.preferred == "eager"
        first = ran.index("eager")
        stretches.append(ran[first:].index(None) if None in ran[first:] else len(ran) - first)
    assert stretches == [BURSTY_TRIAL, SHORT_TRIAL]  # (its last trial lost, and its record)
