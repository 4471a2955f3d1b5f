"""The warm start for any policy (drafter/checkpoint_warm_start.py): it samples the policy's own
responses, trains a head that lands more than a fresh one, exports it under the spectail cache
keyed by the weights, and loads it from there the next time; other weights train anew."""
import random

import pytest
import torch

from drafter.checkpoint_warm_start import Recipe, cache_key, load_or_warm_start_for, sample_own_rollouts
from drafter.features import sequence_features
from drafter.head import DraftHead, HeadConfig
from drafter.simulate import simulated_acceptance
from rollout.kernels import linear

from .conftest import VOCAB, sample_rollouts, sharp_policy

RECIPE = Recipe(samples=3, max_tokens=30, time_budget_s=60.0, batch=16, seed=2, max_steps=120)


def prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))] for _ in range(n)]


def test_warm_start_for_a_policy_trains_caches_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTAIL_CACHE", str(tmp_path / "cache"))
    policy = sharp_policy(seed=11)
    cfg = HeadConfig(draft_vocab=60)
    head, folder, report = load_or_warm_start_for(policy, prompts(), [0], cfg, RECIPE, num_threads=1)
    assert not report["cached"] and folder.parent == tmp_path / "cache" and folder.is_dir()
    assert report["samples"] == 8 * 3 and report["steps"] == 120
    held_out = sample_rollouts(policy, 12, seed=9)
    fresh = DraftHead.for_policy(policy, HeadConfig(draft_vocab=60), seed=2)
    fresh.set_draft_vocab(head.draft_vocab)
    got = simulated_acceptance(head, policy, held_out, 2)["first_token_acceptance"]
    assert got > simulated_acceptance(fresh, policy, held_out, 2)["first_token_acceptance"] + 0.1
    again, folder2, report2 = load_or_warm_start_for(policy, prompts(), [0], cfg, RECIPE)
    assert report2 == {"cached": True} and folder2 == folder
    assert torch.equal(again.draft_vocab, head.draft_vocab)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), head.state_dict().values()))


def test_the_cache_key_follows_weights_config_and_prompts():
    policy = sharp_policy(seed=11)
    key = cache_key(policy, prompts(), [0], HeadConfig(), RECIPE)
    assert key == cache_key(sharp_policy(seed=11), prompts(), [0], HeadConfig(), RECIPE)
    assert key != cache_key(sharp_policy(seed=12), prompts(), [0], HeadConfig(), RECIPE)
    assert key != cache_key(policy, prompts(), [0], HeadConfig(draft_vocab=50), RECIPE)
    assert key != cache_key(policy, prompts(seed=1), [0], HeadConfig(), RECIPE)
    with torch.no_grad():
        policy.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    assert key != cache_key(policy, prompts(), [0], HeadConfig(), RECIPE)


def test_sampling_stops_between_waves_and_keeps_the_engines_features():
    policy = sharp_policy(seed=11)
    got, feats = sample_own_rollouts(policy, prompts(), [], Recipe(samples=2, max_tokens=8, batch=4), seconds=0.0,
                                     num_threads=1)
    assert len(got) == 4  # the first wave only
    assert [r.prompt_ids for r in got] == [prompts()[0]] * 2 + [prompts()[1]] * 2
    assert got[0].seed != got[1].seed and all(1 <= len(r.response_ids) <= 8 for r in got)
    want = sequence_features(policy, [r.token_ids for r in got])
    assert all(f is not None for f in feats)
    for f, w in zip(feats, want):  # the last token's feature is never used (nothing follows it)
        torch.testing.assert_close(f[:-1], w[:-1], atol=1e-4, rtol=1e-4)


def test_features_run_where_the_output_layer_is_packed(monkeypatch):
    """A real model's output layer runs through a packed kernel that pads its rows from the first
    one: the feature forward (warm start, buffer refresh) must not ask it for zero rows."""
    monkeypatch.setattr(linear, "PACK_MIN_WEIGHTS", 0)  # pack even a tiny policy's layers
    policy = sharp_policy(seed=11)
    if linear.make_route(policy.lm_head.weight.detach()) is None:
        pytest.skip("no packed linear kernel on this machine")
    feats = sequence_features(policy, prompts(3))
    assert [f.shape[0] for f in feats] == [len(p) for p in prompts(3)]
