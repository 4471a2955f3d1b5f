"""Plain steps are timed now and then, and speculation is switched off while its steps lose to them."""
import pytest

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.controller import AdaptiveController
from rollout.plain_reference import EARLY_PROBE_EVERY, FIRST_PROBES, MIN_OFF, PROBE_EVERY, TRIAL, PlainReference
from rollout.proposers.base import Draft, Proposer
from tests.conftest import tiny_hf_model

ROWS = 8
PLAIN_STEP = 0.010  # seconds a plain step of ROWS decoding requests takes in these tests


def plain_step(ref: PlainReference) -> None:
    ref.observe(False, ROWS, 0, ROWS, ROWS, PLAIN_STEP)


def spec_step(ref: PlainReference, emitted: int, seconds: float = 2 * PLAIN_STEP) -> None:
    """A speculating step of ROWS requests that fed 3 drafts each."""
    ref.observe(True, 4 * ROWS, 3 * ROWS, ROWS, emitted, seconds)


def steps_until_probe(ref: PlainReference, emitted: int, seconds: float = 2 * PLAIN_STEP) -> int:
    n = 0
    while ref.speculates():
        spec_step(ref, emitted, seconds)
        n += 1
        assert n <= PROBE_EVERY
    return n


def speculate(ref: PlainReference, emitted: int, most: int) -> int:
    """Speculating steps (and the probes due among them) until speculation is switched off, at most
    `most` of them; returns how many ran."""
    n = 0
    while n < most and ref.off_left == 0:
        if ref.speculates():
            spec_step(ref, emitted)
            n += 1
        else:
            plain_step(ref)  # a probe
    return n


def test_a_run_starts_with_a_probe_and_probes_thin_out_once_the_plain_cost_is_known():
    ref = PlainReference()
    ref.new_run(0.5)
    assert not ref.speculates() and not ref.measured
    plain_step(ref)
    assert ref.measured and ref.seconds_per_emitted(ROWS) == pytest.approx(PLAIN_STEP / ROWS)
    gaps = []
    for _ in range(FIRST_PROBES + 1):
        gaps.append(steps_until_probe(ref, emitted=4 * ROWS))  # drafts that pay: never switched off
        plain_step(ref)
    assert gaps[:FIRST_PROBES - 1] == [EARLY_PROBE_EVERY] * (FIRST_PROBES - 1) and gaps[-1] == PROBE_EVERY
    assert ref.off_left == 0 and ref.ratio == pytest.approx(0.5)  # twice the time for four times the tokens


def test_steps_that_lose_to_plain_switch_speculation_off_for_a_wait_that_doubles():
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    assert speculate(ref, ROWS + 1, 100) == TRIAL  # twice the time for one more token: judged after a trial
    assert ref.off_left == MIN_OFF
    for _ in range(MIN_OFF):
        assert not ref.speculates()
        plain_step(ref)
    assert ref.speculates()  # a trial again
    assert speculate(ref, ROWS + 1, 100) == TRIAL and ref.off_left == 2 * MIN_OFF

    ref.new_run(0.5)  # a new run tries at once (after its probe); the wait it earned is kept
    assert ref.off_left == 0 and ref.wait == 4 * MIN_OFF
    plain_step(ref)
    assert speculate(ref, 4 * ROWS, TRIAL) == TRIAL  # drafts land now
    assert ref.off_left == 0 and ref.wait == MIN_OFF  # a winning trial: the next loss waits the least


def test_slight_losses_double_the_wait_once_a_second_trial_confirms_them():
    ref = PlainReference()
    ref.new_run(0.5)
    plain_step(ref)
    slight = round(2 * ROWS / 1.1)  # about 1.1x the plain time: under CLEAR_LOSS
    waits = []
    for _ in range(4):
        assert speculate(ref, slight, 100) == TRIAL
        waits.append(ref.off_left)
        for _ in range(ref.off_left):
            plain_step(ref)
    assert waits == [MIN_OFF, MIN_OFF, 2 * MIN_OFF, 4 * MIN_OFF]  # the first may be noise; the next are not
    restored = PlainReference()
    restored.load_state_dict(ref.state_dict())
    assert restored.lost and restored.wait == ref.wait
    assert speculate(ref, 4 * ROWS, TRIAL) == TRIAL and ref.off_left == 0  # drafts land: back to the shortest wait
    assert not ref.lost and ref.wait == MIN_OFF


def test_the_plain_cost_is_fitted_against_the_tokens_a_step_feeds():
    ref = PlainReference()
    for n in (8, 64, 8, 64):
        ref.observe(False, n, 0, n, n, 0.002 + n * 0.0001)
    assert ref.seconds_per_emitted(16) == pytest.approx((0.002 + 16 * 0.0001) / 16)
    # a step with a prompt chunk of 56 tokens besides 8 decoding rows: plain would feed those too,
    # once: its 32 tokens take 4 plain steps, the first with the chunk, three of 8 rows
    ref.observe(True, 8 + 56 + 24, 24, 8, 32, 0.002 + 88 * 0.0001)
    w, spent, plain = ref.ledger
    assert plain == pytest.approx((0.002 + 64 * 0.0001) + 3 * (0.002 + 8 * 0.0001))


def test_a_priced_controller_values_an_accepted_token_at_what_a_plain_step_spends_per_token():
    c = AdaptiveController()
    c.add_profile(8, 0.018)
    c.add_profile(72, 0.082)
    assert c.speculates()  # nothing says it loses yet
    before = c.seconds_per_emitted(8)
    for _ in range(3):
        c.observe_step(8, 8, 0.004, rows=8, planned=False)  # plain steps, timed: cheaper than the profile says
    assert c.seconds_per_emitted(8) < before
    assert c.seconds_per_emitted(8) == pytest.approx(c.plain.cost.predict(8) / 8)
    assert AdaptiveController(min_draft_prob=0.2).speculates()  # a fixed threshold never probes


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
        return 0.001 + 0.001 * done.fed + (self.planned if done.planned else 0.0)


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
