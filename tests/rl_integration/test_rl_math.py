"""GRPO and PPO arithmetic against values computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from rl_integration.grpo import clipped_policy_loss, group_advantages, k3_kl, masked_aggregate
from rl_integration.ppo import clipped_value_loss, gae, token_rewards, whiten


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_group_advantages_by_hand():
    rewards = [1, 0, 0, 1, 1, 1, 1, 1, 0, 1]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 1: all equal; group 2: std 0.70711
    a = 0.5 / math.sqrt(1 / 3)
    b = 0.5 / math.sqrt(0.5)
    assert close(group_advantages(rewards, groups, eps=0.0), [a, -a, -a, a, 0, 0, 0, 0, -b, b])
    c, d = 0.5 / (math.sqrt(1 / 3) + 0.1), 0.5 / (math.sqrt(0.5) + 0.1)
    assert close(group_advantages(rewards, groups, eps=0.1), [c, -c, -c, c, 0, 0, 0, 0, -d, d])
    # Dr. GRPO: no division by the std
    assert close(group_advantages(rewards, groups, scale=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.5, 0.5])
    # group ids need not be contiguous or sorted; a group of one gets 0
    # group 9 = [3, 7]: mean 5, std sqrt(8) -> -+2 / 2.828
    assert close(group_advantages([3.0, 1.0, 7.0], [9, 4, 9], eps=0.0), [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)])
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0], [0])


def test_clipped_policy_loss_by_hand():
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    old = torch.zeros_like(ratio)
    loss, clipped = clipped_policy_loss(ratio.log(), old, adv, 0.2)
    # 1.5*A=1.5 vs 1.2 -> 1.2 (clipped) | -1.5 vs -1.2 -> -1.5 | 0.5 vs 0.8 -> 0.5 | -0.5 vs -0.8 -> -0.8 (clipped)
    assert close(loss, [[-1.2, 1.5, -0.5, 0.8, -2.2]])
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    # DAPO clip-higher: the upper bound is 1 + 0.28
    loss, _ = clipped_policy_loss(ratio.log(), old, adv, 0.2, clip_high=0.28)
    assert close(loss, [[-1.28, 1.5, -0.5, 0.8, -2.2]])
    # on-policy (ratio 1) the gradient is -A * grad(logp)
    lp = torch.zeros(1, 2, requires_grad=True)
    clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([[2.0, -3.0]]), 0.2)[0].sum().backward()
    assert close(lp.grad, [[-2.0, 3.0]])


def test_k3_kl_by_hand():
    kl = k3_kl(torch.tensor([math.log(0.5), math.log(0.3)]), torch.tensor([math.log(0.25), math.log(0.3)]))
    # d = log(0.25 / 0.5): exp(d) - d - 1 = 0.5 + 0.693147 - 1
    assert close(kl, [0.5 + math.log(2) - 1, 0.0])


def test_masked_aggregate_token_and_sequence_means():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(masked_aggregate(values, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(masked_aggregate(values, mask, "seq_mean")) == pytest.approx((2 + 4) / 2)
    # a micro-batch divides by the whole minibatch's counts: the parts add up to the whole
    top = masked_aggregate(values[:1], mask[:1], "token_mean", num_tokens=4)
    bottom = masked_aggregate(values[1:], mask[1:], "token_mean", num_tokens=4)
    assert float(top + bottom) == pytest.approx(2.5)
    top = masked_aggregate(values[:1], mask[:1], "seq_mean", num_seqs=2)
    bottom = masked_aggregate(values[1:], mask[1:], "seq_mean", num_seqs=2)
    assert float(top + bottom) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="token_mean"):
        masked_aggregate(values, mask, "sum")


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 sits on padding: ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: d2 = 1 - .7 = .3; d1 = .7 - .6 = .1 -> .1 + .5*.3 = .25; d0 = .6 - .5 = .1 -> .1 + .5*.25 = .225
    # row 1: d1 = 1 + 0 - .4 = .6; d0 = .4 - .2 = .2 -> .2 + .5*.6 = .5
    assert close(adv, [[0.225, 0.25, 0.3], [0.5, 0.6, 0.0]])
    assert close(ret, [[0.725, 0.85, 1.0], [0.7, 1.0, 0.0]])
    adv, _ = gae(rewards[:1], values[:1], mask[:1], gamma=0.9, lam=1.0)
    # d2 = .3; d1 = .9*.7 - .6 = .03 -> .03 + .9*.3 = .3; d0 = .9*.6 - .5 = .04 -> .04 + .9*.3 = .31
    assert close(adv, [[0.31, 0.3, 0.3]])


def test_token_rewards_and_whiten_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    r = token_rewards([1.0, 2.0], mask, kl, kl_coef=0.5)
    assert close(r, [[-0.05, -0.1, 1.0 - 0.15], [-0.2, 2.0 - 0.25, 0.0]])
    w = whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert close(w, [[-1.0, 1.0, 0.0]], tol=1e-6)


def test_clipped_value_loss_by_hand():
    v = torch.tensor([0.9, 0.55, 0.2])
    old = torch.tensor([0.5, 0.5, 0.5])
    ret = torch.tensor([1.0, 1.0, 0.0])
    loss, clipped = clipped_value_loss(v, old, ret, 0.2)
    # 0.9: (0.9-1)^2=.01 vs clipped 0.7: .09 -> .045 | 0.55: inside the clip -> .2025/2 | 0.2: .04 vs 0.3^2=.09 -> .045
    assert close(loss, [0.045, 0.10125, 0.045])
    assert clipped.tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_micro_batches_give_the_minibatch_gradient(agg, algorithm):
    from rl_integration.config import RolloutSection, TrainerSection
    from rl_integration.grpo import GRPOTrainer
    from rl_integration.ppo import PPOTrainer
    from rl_integration.rollout_client import RolloutClient
    from rollout import EngineConfig
    from tests.conftest import tiny_hf_model

    model = tiny_hf_model("llama", seed=2)
    client = RolloutClient(RolloutSection(max_tokens=6, n=3, engine=EngineConfig(max_model_len=64)), model, seed=0,
                           stop_token_ids=[2])
    batch = client.generate([[1, 5, 6], [1, 7]])
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
    cfg = TrainerSection(algorithm=algorithm, loss_agg=agg, kl_coef=0.1)
    trainer = (GRPOTrainer if algorithm == "grpo" else PPOTrainer)(model, cfg, temperature=1.0)
    prep = trainer.prepare(batch, trainer.advantages(batch, rewards))
    if algorithm == "ppo":  # a non-zero critic, so the value loss has a gradient too
        torch.nn.init.normal_(trainer.value_head.linear.weight, std=0.1)
    idx = list(range(len(batch)))
    norm = {"num_tokens": float(sum(len(c) for c in batch.completion_ids)), "num_seqs": float(len(idx))}

    def grads(micro):
        for p in trainer.parameters():
            p.grad = None
        for u in range(0, len(idx), micro):
            trainer.sample_loss(batch, prep, idx[u:u + micro], norm)[0].backward()
        return torch.cat([p.grad.flatten() for p in trainer.parameters() if p.grad is not None])

    whole = grads(len(idx))
    assert whole.abs().sum() > 0
    for micro in (1, 4):
        assert torch.allclose(grads(micro), whole, atol=1e-6, rtol=1e-4)
