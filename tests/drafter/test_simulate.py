"""Alignment and the offline acceptance metric: an oracle head (the policy's own next logits) is
accepted everywhere; a random head is accepted as often as Gumbel coupling predicts."""
import math

import pytest
import torch
import torch.nn.functional as F

from drafter.features import row_batch, sequence_features
from drafter.head import DraftHead, HeadConfig
from drafter.simulate import chain_runs, simulated_acceptance, summarize
from rollout import SamplingParams
from rollout.core import sampling
from tests.conftest import tiny_hf_model
from tests.drafter.conftest import VOCAB, sample_rollouts


class OracleHead:
    """Returns, at every step of every chain, the policy's own hidden state for the next
    position (row j -> h_{j+1}): what a perfect head would predict on the accepted path."""

    def unroll(self, policy, tokens, feats, steps, pick=None):
        out = torch.cat([feats[:, 1:], torch.zeros_like(feats[:, :1])], dim=1)
        logits = F.linear(out, policy.lm_head.weight).float()
        return [(out, logits)] * steps


def test_features_are_the_policys_hidden_states(policy, rollouts):
    rolls, feats = rollouts
    hf = tiny_hf_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
        for r, f in list(zip(rolls, feats))[:4]:
            logits = hf(torch.tensor([r.token_ids])).logits[0]
            torch.testing.assert_close(policy.lm_head(f), logits, atol=1e-4, rtol=1e-4)
    # packing several per forward, or one long sequence in chunks, changes nothing
    chunked = sequence_features(policy, [r.token_ids for r in rolls[:6]], tokens_per_forward=16)
    for a, b in zip(chunked, feats[:6]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=30),
                                    SamplingParams(temperature=0.7, top_k=7, top_p=0.9, max_tokens=30),
                                    SamplingParams(temperature=0.0, max_tokens=30)],
                         ids=["T1", "topk-topp", "greedy"])
def test_oracle_head_is_accepted_everywhere(policy, params):
    rolls = sample_rollouts(policy, 10, seed=2, params=params)
    runs = chain_runs(OracleHead(), policy, rolls, max_k=8)
    for r, per_start in zip(rolls, runs):
        assert len(per_start) == len(r.response_ids) - 1
        assert all(run == n == min(8, len(r.response_ids) - 1 - t) for t, (run, n) in enumerate(per_start))
    s = summarize(runs, 8)
    assert s["per_token_acceptance"] == 1.0 and s["first_token_acceptance"] == 1.0


def test_a_shifted_oracle_is_not_accepted(policy, rollouts):
    """The oracle test can fail: an off-by-one in the features is caught."""
    rolls, feats = rollouts

    class LateOracle(OracleHead):
        def unroll(self, policy, tokens, feats, steps, pick=None):
            return super().unroll(policy, tokens, torch.cat([feats[:, 1:], feats[:, -1:]], dim=1), steps, pick)

    assert simulated_acceptance(LateOracle(), policy, rolls, 4, feats)["first_token_acceptance"] < 0.7


def coupling_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(argmax(log p + G) == argmax(log q + G)) for shared Gumbel noise G, exactly:
    sum_v 1 / sum_w max(p_w / p_v, q_w / q_v) (v wins both races iff G_v - G_w beats both gaps)."""
    p, q = p.double(), q.double()
    ratio = torch.maximum(p[:, None, :] / p[:, :, None], q[:, None, :] / q[:, :, None])  # [M, v, w]
    return (1.0 / ratio.sum(-1)).sum(-1)


def test_random_head_acceptance_is_what_gumbel_coupling_predicts(policy, rollouts):
    rolls, feats = rollouts
    head = DraftHead.for_policy(policy, HeadConfig(), seed=11)
    with torch.no_grad():
        head.fc.weight.mul_(3.0)  # move it further from the policy: a TV distance well inside (0, 1)
    runs = chain_runs(head, policy, rolls, max_k=1, features=feats)
    measured = [run for per in runs for run, _ in per]

    rb = row_batch(rolls, feats)
    b, j = rb.valid(0).nonzero(as_tuple=True)
    with torch.no_grad():
        q = torch.softmax(head.unroll(policy, rb.tokens, rb.feats, 1)[0][1][b, j], -1)
        p = torch.softmax(policy.lm_head(rb.next_feats[b, j]).float(), -1)
    exact = coupling_probability(p, q)
    tv = 0.5 * (p - q).abs().sum(-1).double()
    bound = (1 - tv) / (1 + tv)
    assert len(measured) == exact.numel() > 500
    assert bool((exact >= bound - 1e-9).all())
    mean_tv = float(tv.mean())
    assert 0.2 < mean_tv < 0.8, mean_tv
    sigma = math.sqrt(float((exact * (1 - exact)).sum())) / len(measured)
    rate = sum(measured) / len(measured)
    assert abs(rate - float(exact.mean())) < 4 * sigma, (rate, float(exact.mean()), sigma)
    assert rate > float(bound.mean()) - 4 * sigma


def test_coupled_drafts_use_the_samples_noise(policy, rollouts):
    """A draft is rollout.core.sampling's coupled sample at (seed, response position)."""
    rolls, feats = rollouts
    rb = row_batch(rolls[:3], feats[:3])
    from drafter.simulate import coupled_drafts
    with torch.no_grad():
        logits = policy.lm_head(rb.next_feats).float()
    drafts = coupled_drafts(rb, 0, logits)
    b, j = 1, int(rb.first[1]) + 2
    t = j + 2 - len(rolls[1].prompt_ids)  # the response position row j drafts
    want, _ = sampling.sample(logits[b, j][None], torch.tensor([rolls[1].seed]), torch.tensor([t]),
                              torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    assert int(drafts[b, j]) == int(want[0]) == rolls[1].response_ids[t]
