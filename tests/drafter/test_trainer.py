"""Training: the loss goes down and simulated acceptance goes up; the teacher is the policy's
processed distribution through its live lm_head; reward weighting weighs rows as documented."""
import pytest
import torch

from drafter.buffer import FeatureBuffer
from drafter.features import SavedRollout, row_batch
from drafter.head import DraftHead, HeadConfig
from drafter.simulate import simulated_acceptance
from drafter.trainer import TrainConfig, batch_loss, new_state, teacher, train
from drafter.warm_start import warm_start
from rollout.core import sampling
from tests.drafter.conftest import sample_rollouts


def fill(rolls, feats, max_tokens=100_000):
    buf = FeatureBuffer(max_tokens)
    for r, f in zip(rolls, feats):
        buf.add(r, f, version=0)
    return buf


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_training_lowers_the_loss_and_raises_acceptance(policy, rollouts, kind):
    rolls, feats = rollouts
    test = sample_rollouts(policy, 12, seed=9)
    head = DraftHead.for_policy(policy, HeadConfig(kind=kind), seed=0)
    before = simulated_acceptance(head, policy, test, 4)["per_token_acceptance"]
    cfg = TrainConfig(lr=3e-3, batch_tokens=1024)
    state = new_state(head, cfg)
    first = train(state, policy, fill(rolls, feats), cfg, time_budget_s=60, max_steps=5)
    later = train(state, policy, fill(rolls, feats), cfg, time_budget_s=60, max_steps=40)
    after = simulated_acceptance(head, policy, test, 4)["per_token_acceptance"]
    assert first["steps"] == 5 and later["steps"] == 40 and state.steps == 45
    assert later["last_loss"] < 0.5 * first["loss"], (first, later)
    assert after > before + 0.15, (before, after)


def test_training_leaves_the_policy_alone(policy, rollouts):
    rolls, feats = rollouts
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    train(new_state(head), policy, fill(rolls, feats), TrainConfig(), time_budget_s=60, max_steps=2)
    for k, v in policy.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in policy.parameters())


def test_head_reads_the_policys_live_weights(policy, rollouts):
    """No copy: changing the policy's lm_head / embeddings changes the head's output."""
    from rollout.core.model import CausalLM
    from tests.drafter.conftest import sharp_policy

    pol = sharp_policy(seed=3)
    head = DraftHead.for_policy(pol, HeadConfig(), seed=0)
    tokens, feats = torch.tensor([[3, 4, 5]]), torch.randn(1, 3, pol.cfg.hidden_size)
    out, logits = head.unroll(pol, tokens, feats, 1)[0]
    new_w = torch.randn_like(pol.lm_head.weight)
    pol.load_weights([("lm_head.weight", new_w)])
    out2, logits2 = head.unroll(pol, tokens, feats, 1)[0]
    torch.testing.assert_close(out2, out)  # this policy's embeddings are not tied to lm_head
    torch.testing.assert_close(logits2, (out2 @ new_w.T).float())
    pol.load_weights([("model.embed_tokens.weight", torch.randn_like(pol.model.embed_tokens.weight))])
    assert not torch.allclose(head.unroll(pol, tokens, feats, 1)[0][0], out)
    assert isinstance(pol, CausalLM)


def test_teacher_is_the_processed_distribution(policy, rollouts):
    rolls, feats = rollouts
    mixed = [SavedRollout(r.prompt_ids, r.response_ids, r.seed, t, k, p)
             for r, (t, k, p) in zip(rolls[:3], [(0.7, 5, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0)])]
    rb = row_batch(mixed, feats[:3])
    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    b, j = rb.valid(0).nonzero(as_tuple=True)
    probs = teacher(policy, head, rb, b, j)
    with torch.no_grad():
        z = sampling.process_logits(policy.lm_head(rb.next_feats[b, j]), rb.temperature[b], rb.top_k[b], rb.top_p[b])
    torch.testing.assert_close(probs[b == 0], torch.softmax(z[b == 0], -1))
    assert bool(((probs[b == 0] > 0).sum(-1) == 5).all())  # top-k 5
    assert bool(((probs[b == 1] > 0).sum(-1) < policy.cfg.vocab_size).all())  # top-p cut something
    greedy = probs[b == 2]
    assert bool((greedy.max(-1).values == 1).all()) and bool((greedy.argmax(-1) == z[b == 2].argmax(-1)).all())


def test_reward_weighting_weighs_each_samples_rows(policy, rollouts):
    rolls, feats = rollouts
    r = rolls[1]
    short = SavedRollout(r.prompt_ids, r.response_ids[:12], r.seed)  # a prefix: its features are a prefix
    a, fa = rolls[0], feats[0]
    b, fb = short, feats[1][:len(short.token_ids)]
    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    cfg = TrainConfig(ttt_steps=1)
    with torch.no_grad():
        la, _ = batch_loss(head, policy, row_batch([a], [fa]), cfg)
        lb, _ = batch_loss(head, policy, row_batch([b], [fb]), cfg)
        both, _ = batch_loss(head, policy, row_batch([a, b], [fa, fb], weights=[1.0, 3.0]), cfg)
    na, nb = len(a.response_ids) - 1, len(b.response_ids) - 1  # rows drafting y_1 .. y_{R-1}
    assert na != nb
    torch.testing.assert_close(both, (la * na + 3 * lb * nb) / (na + 3 * nb))


def test_warm_start_reports_what_it_did(policy, rollouts):
    rolls, _ = rollouts
    head, state, report = warm_start(policy, rolls, HeadConfig(kind="mlp"), TrainConfig(), time_budget_s=60,
                                     max_steps=3)
    assert report["steps"] == 3 == state.steps and report["samples"] == len(rolls)
    assert report["parameters"] == head.num_parameters() and report["loss"] > 0 and report["seconds"] > 0
    with pytest.raises(ValueError, match="at least one rollout"):
        warm_start(policy, [])


def test_bad_train_config_is_refused():
    for bad, field in [(dict(lr=0), "lr"), (dict(ttt_steps=0), "ttt_steps"), (dict(step_decay=1.5), "step_decay"),
                       (dict(reward_beta=-1), "reward_beta"), (dict(decay="linear"), "decay")]:
        with pytest.raises(ValueError, match=field):
            TrainConfig(**bad).validate()


def test_cosine_decay_falls_to_a_twentieth_over_the_budget():
    from drafter.trainer import _set_lr

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    seen = []
    for progress in (0.0, 0.5, 1.0, 2.0):
        _set_lr(opt, TrainConfig(lr=0.1, decay="cosine"), progress)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.1, 0.0525, 0.005, 0.005])
    _set_lr(opt, TrainConfig(lr=0.1), 0.7)
    assert opt.param_groups[0]["lr"] == 0.1


def test_load_or_warm_start_caches_the_head(policy, rollouts, tmp_path):
    from drafter.warm_start import load_or_warm_start

    rolls, _ = rollouts
    calls = []

    def make():
        calls.append(1)
        return rolls

    head, report = load_or_warm_start(tmp_path / "head", policy, make, HeadConfig(kind="mlp"), max_steps=2)
    assert not report["cached"] and report["steps"] == 2 and calls == [1]
    again, report = load_or_warm_start(tmp_path / "head", policy, make, HeadConfig(kind="mlp"), max_steps=2)
    assert report["cached"] and calls == [1]
    for a, b in zip(head.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    (tmp_path / "head" / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match="retraining"):
        _, report = load_or_warm_start(tmp_path / "head", policy, make, HeadConfig(kind="mlp"), max_steps=1)
    assert not report["cached"] and calls == [1, 1]


def test_should_stop_ends_training_between_steps_keeping_what_was_done(policy, rollouts):
    """A Ray worker's slice gives the engine back to a chunk through should_stop: checked before
    every step, it ends the call there; the steps before it count and changed the head."""
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(), seed=0)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    state = new_state(head)
    calls = []

    def should_stop():
        calls.append(len(calls))
        return len(calls) > 3  # the 4th check, before a 4th step

    out = train(state, policy, fill(rolls, feats), TrainConfig(), time_budget_s=60, max_steps=50,
                should_stop=should_stop)
    assert out["steps"] == 3 and out["stopped"] and state.steps == 3 and len(calls) == 4
    assert any(not torch.equal(v, before[k]) for k, v in head.state_dict().items())
    again = train(state, policy, fill(rolls, feats), TrainConfig(), time_budget_s=60, max_steps=2,
                  should_stop=lambda: False)
    assert again["steps"] == 2 and not again["stopped"] and state.steps == 5
