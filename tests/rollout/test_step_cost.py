"""The step-cost plane: seconds = fixed + per_token x fed + per_attended x attended context."""
import itertools

import pytest
import torch

from rollout.engine import Row, Work
from rollout.plain_reference import TRIAL, PlainReference
from rollout.step_cost import StepCost, attended


def plane(fed, ctx):
    return 0.002 + 0.0001 * fed + 1e-6 * ctx  # seconds of a step in these tests


def test_attended_counts_what_a_causal_mask_lets_the_new_tokens_read():
    for cached, n in itertools.product((0, 1, 7), (0, 1, 5)):
        mask = torch.ones(n, cached + n).tril(diagonal=cached)
        assert attended(cached, n) == int(mask.sum())


def test_the_plane_is_recovered_from_steps_that_vary_in_both():
    cost = StepCost()
    for fed, ctx in itertools.product((8, 24, 72), (500, 4000, 9000)):
        cost.observe(fed, plane(fed, ctx), ctx)
    assert cost.plane() == pytest.approx((0.002, 0.0001, 1e-6), rel=1e-6)
    assert cost.predict(40, 2000) == pytest.approx(plane(40, 2000))


def test_without_a_context_the_fit_is_the_line_in_tokens_and_old_checkpoints_load():
    cost = StepCost()
    cost.add_profile(8, 0.010 + 8 * 0.001)
    cost.add_profile(72, 0.010 + 72 * 0.001)
    for n in range(1, 60):
        cost.observe(n % 40 + 1, 0.002 + (n % 40 + 1) * 0.004)
    assert cost.per_attended() == 0.0
    old = {"sums": [cost.sums[i] for i in (0, 1, 3, 4, 7)], "anchor": [cost.anchor[i] for i in (0, 1, 3, 4, 7)]}
    assert StepCost.from_state_dict(old).fit() == pytest.approx(cost.fit())
    assert StepCost.from_state_dict(cost.state_dict()).plane() == cost.plane()


def test_the_profile_gives_both_slopes_before_any_step():
    cost = StepCost()
    for fed, ctx in ((8, 8), (72, 360), (8, 8 * 513)):  # rollout/engine.py Engine._profile's three forwards
        cost.add_profile(fed, plane(fed, ctx), ctx)
    assert cost.plane() == pytest.approx((0.002, 0.0001, 1e-6), rel=1e-6)
    for _ in range(100):  # steps of one size and context: the slopes stay the profile's
        cost.observe(64, plane(64, 6400), 6400)
    assert cost.plane() == pytest.approx((0.002, 0.0001, 1e-6), rel=1e-6)


def test_speculation_at_a_short_context_is_weighed_against_plain_steps_at_that_context():
    """Probes timed late in a run (long contexts) cost more than plain steps early in the next:
    drafting steps there that lose to plain ones at their own context must read as losing."""
    rows = 8
    for counted in (True, False):
        ref = PlainReference()
        for ctx in (4000, 6000, 8000):  # the last run's probes
            ref.observe(None, rows, 0, rows, rows, plane(rows, ctx), Work(ctx, ctx, ctx) if counted else None)
        ctx = 800
        seconds = 1.25 * 2 * plane(rows, ctx)  # 2 tokens a request: a quarter slower than 2 plain steps
        for _ in range(TRIAL):
            ref.observe("budget", 4 * rows, 3 * rows, rows, 2 * rows, seconds,
                        Work(4 * ctx + 6 * rows, ctx, ctx + rows) if counted else None)
        off = ref.ledgers["budget"].off_left > 0
        assert off == counted  # (uncounted, the probes' long contexts make it read as a gain)


def test_a_step_counts_the_context_its_rows_attend_over():
    class Req:
        def __init__(self, cached):
            self.num_cached = cached

    class D:
        tokens = [5, 6, 7]

    decoding = Row(Req(10), 1, D(), 0)  # the pending token and 3 drafts after 10 cached tokens
    chunk = Row(Req(0), 4, None, None)  # a prompt chunk short of its prompt's end
    work = Work.of([decoding, chunk])
    assert work.attended == attended(10, 4) + attended(0, 4)
    assert work.plain == attended(10, 1) + attended(0, 4)
    assert work.context == 12  # the next plain step of the decoding request reads 12 tokens


def test_the_plain_counterpart_of_a_step_reads_a_growing_context():
    """32 tokens for 8 requests take 4 plain steps: the first feeds what the step fed but its
    drafts, the next three a token a request at a context 8 tokens longer each step."""
    ref = PlainReference()
    for ctx in (400, 800, 1600, 3200):
        ref.observe(None, 8, 0, 8, 8, plane(8, ctx), Work(ctx, ctx, ctx))
    ref.observe("budget", 32, 24, 8, 32, 0.05, Work(3000, 800, 808))
    w, spent, plain_seconds = ref.ledgers["budget"].sums
    assert plain_seconds == pytest.approx(plane(8, 800) + sum(plane(8, 808 + 8 * j) for j in range(3)))
