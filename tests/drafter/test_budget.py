"""The head's budget: the pace it converts seconds with, which requests and positions pay, and an
engine whose drafter prices its head (no fixed min_draft_prob) still emits the plain tokens."""
import pytest

from drafter.budget import Backoff, Pace, PositionClock, copy_limit, worth_another_position, worth_running
from drafter.head import DraftHead, HeadConfig
from drafter.proposer import DrafterProposer
from rollout import Engine, EngineConfig, SpecConfig
from tests.drafter.test_proposer import workload


def test_pace_is_seconds_over_emitted_tokens_and_skips_idle_gaps():
    pace = Pace()
    assert pace.seconds_per_emitted() is None
    pace.tick(10.0)
    pace.count(4)
    pace.tick(10.2)  # 0.2 s for 4 tokens
    assert pace.seconds_per_emitted() == pytest.approx(0.05)
    pace.idle()
    pace.count(2)
    pace.tick(99.0)  # after a gap between rollouts: only a new mark
    assert pace.seconds_per_emitted() == pytest.approx(0.05)
    pace.count(10)
    pace.tick(99.1)
    assert pace.seconds_per_emitted() == pytest.approx((0.2 * 0.9 + 0.1) / (4 * 0.9 + 10))


def test_a_request_is_drafted_when_its_gain_over_the_copy_pays_for_its_rows():
    # rate 0.9, k 4: expected run 3.0951 (all four tokens beat the threshold 0.1), surplus over
    # the four verify slots' price 3.0951 - 4 x 0.1
    assert copy_limit(0.9, 4, 0.1, 0.0, None) == pytest.approx(0.9 + 0.81 + 0.729 + 0.6561 - 0.4)
    # its 4 rows in the head cost 4 x 0.1 emitted token more
    assert copy_limit(0.9, 4, 0.1, 0.001, 0.01) == pytest.approx(2.6951 - 0.4)
    assert copy_limit(0.9, 4, 0.1, 0.01, 0.01) == 0.0  # 4 rows x 1 token: never worth it
    assert copy_limit(0.05, 4, 0.1, 0.0, None) == 0.0  # no token beats the threshold


def test_another_position_pays_when_its_tokens_outweigh_the_forward():
    reach, rates = [0.9, 0.5, 0.05], [0.9, 0.9, 0.9]
    gain = (0.81 - 0.1) + (0.45 - 0.1)  # the third chain's token is not worth its slot
    assert worth_another_position(reach, rates, 0.1, gain * 0.01 * 0.99, 0.01)
    assert not worth_another_position(reach, rates, 0.1, gain * 0.01 * 1.01, 0.01)
    assert worth_another_position(reach, rates, 0.1, 1e9, None)  # before the pace is known


def test_a_priced_drafter_changes_no_token(policy):
    prompts, params, seeds = workload(n=10, seed=4)
    ref = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96)).generate(prompts, params, seeds)
    spec = SpecConfig(proposers=("suffix", "drafter"), max_draft_tokens=5)  # priced: min_draft_prob None
    eng = Engine(policy, EngineConfig(max_batch_size=4, max_model_len=96, spec=spec))
    dp = DrafterProposer.of(eng)
    dp.set_head(DraftHead.for_policy(policy, HeadConfig(intermediate_size=16, num_heads=2, num_kv_heads=1), seed=2), 1)
    for _ in range(2):
        out = eng.generate(prompts, params, seeds)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    # every request left: the next run's first step is not timed against this one's last
    assert dp.active == 0 and dp.pace.mark is None


def test_the_clock_times_each_position_run_after_a_mark():
    clock = PositionClock(marks=[(1.0, 5, True), (1.5, 3, True), (1.75, 2, False)])
    assert clock.positions(9.0) == [(5, 0.5), (3, 0.25)]  # nothing ran after the refused mark
    clock = PositionClock(marks=[(1.0, 5, True)])
    assert clock.positions(1.25) == [(5, 0.25)]  # the last position ended with the call
    assert clock.mark(4, False) is False and clock.marks[-1][1:] == (4, False)


def test_the_head_runs_a_step_only_when_the_gains_pay_for_all_its_positions():
    gains = [(3.0, 3), (1.0, 1)]  # positions 2 and 3 run for the first request only

    def position_s(n):
        return 0.001 + 0.0005 * n

    cost = 0.004 + 2 * position_s(1)  # first position, then two more for one request
    assert worth_running(gains, 0.004, position_s, cost / 4 * 1.01)
    assert not worth_running(gains, 0.004, position_s, cost / 4 * 0.99)
    assert worth_running(gains, 1e9, position_s, None) and not worth_running([], 0.0, position_s, 1.0)


def test_the_backoff_doubles_while_the_head_does_not_pay():
    b, skipped = Backoff(), []
    for ran in (False, False, False, False, False, True, False):
        b.result(ran)
        n = 0
        while b.skip():
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 8, 0, 1]
    b.result(False)
    b.reset()
    assert not b.skip()
