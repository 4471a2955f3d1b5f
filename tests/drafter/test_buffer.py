"""The feature ring: bounded by tokens, oldest out first, partial responses replaced in place,
bad input refused before anything changes, stale features recomputed under new weights."""
import pytest
import torch

from drafter.buffer import FeatureBuffer
from drafter.features import SavedRollout, sequence_features


def sample(n_prompt, n_resp, seed=0):
    return SavedRollout(list(range(1, n_prompt + 1)), list(range(10, 10 + n_resp)), seed)


def feats(s, d=8):
    return torch.randn(len(s.token_ids), d)


def test_budget_evicts_the_oldest_first():
    buf = FeatureBuffer(50)
    samples = [sample(3, 7, seed=i) for i in range(8)]  # 10 tokens each
    for i, s in enumerate(samples):
        buf.add(s, feats(s), version=i)
        assert buf.total_tokens <= 50
    assert len(buf) == 5 and buf.total_tokens == 50
    assert [e.sample.seed for e in buf] == [3, 4, 5, 6, 7]
    assert buf.versions() == {3: 10, 4: 10, 5: 10, 6: 10, 7: 10}


def test_a_growing_partial_response_replaces_itself():
    buf = FeatureBuffer(100)
    short, longer = sample(3, 4, seed=1), sample(3, 9, seed=1)
    buf.add(sample(2, 2, seed=0), feats(sample(2, 2)), 0)
    buf.add(short, feats(short), 0, finished=False, key="req-1")
    buf.add(longer, feats(longer), 0, finished=True, key="req-1")
    assert len(buf) == 2 and buf.total_tokens == 4 + 12
    newest = list(buf)[-1]
    assert newest.finished and newest.sample is longer


def test_bad_entries_are_refused_and_change_nothing():
    buf = FeatureBuffer(20)
    ok = sample(2, 3)
    buf.add(ok, feats(ok), 0)
    big = sample(10, 15)
    with pytest.raises(ValueError, match="does not fit"):
        buf.add(big, feats(big), 0)
    with pytest.raises(ValueError, match=r"features must be \[5, hidden\]"):
        buf.add(ok, torch.randn(4, 8), 0)
    nan = feats(ok)
    nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        buf.add(ok, nan, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        FeatureBuffer(0)
    assert len(buf) == 1 and buf.total_tokens == 5


def test_storage_dtype():
    buf = FeatureBuffer(100, dtype=torch.bfloat16)
    s = sample(2, 3)
    buf.add(s, feats(s), 0)
    assert next(iter(buf)).features.dtype == torch.bfloat16


def test_refresh_recomputes_stale_features_under_new_weights(policy, rollouts):
    from tests.drafter.conftest import sharp_policy

    rolls, _ = rollouts
    pol = sharp_policy(seed=3)
    buf = FeatureBuffer(10_000)
    old = sequence_features(pol, [r.token_ids for r in rolls[:3]])
    for r, f in zip(rolls[:3], old):
        buf.add(r, f, version=0)
    buf.add(rolls[3], sequence_features(pol, [rolls[3].token_ids])[0], version=1)
    w = pol.model.layers[0].mlp.up_proj.weight
    pol.load_weights([("model.layers.0.mlp.up_proj.weight", w * 1.5)])
    assert buf.refresh(pol, version=1) == sum(len(r.token_ids) for r in rolls[:3])
    new = sequence_features(pol, [r.token_ids for r in rolls[:4]])
    entries = list(buf)
    for e, f, o in zip(entries[:3], new, old):
        assert e.version == 1
        torch.testing.assert_close(e.features, f)
        assert not torch.allclose(e.features, o)
    assert not torch.allclose(entries[3].features, new[3])  # it was current: left alone
    assert buf.refresh(pol, version=1) == 0


def test_refresh_on_a_policy_whose_output_layer_packs():
    """The crash of `spectail train` with the drafter on a real checkpoint: sequence_features
    asks no logit rows, and an lm_head large enough for oneDNN's packed path got 0 rows."""
    from rollout.core.model import CausalLM
    from rollout.kernels.linear import PACK_MIN_WEIGHTS, packs
    from tests.conftest import tiny_hf_model

    policy = CausalLM.from_pretrained(tiny_hf_model("llama", vocab=4096, seed=5))
    assert policy.lm_head.weight.numel() >= PACK_MIN_WEIGHTS
    if not packs(policy.lm_head.weight):
        pytest.skip("this torch has no oneDNN path for the output layer")
    buf = FeatureBuffer(1000)
    s = SavedRollout([1, 2, 3], [40, 50, 60, 70], seed=1)
    buf.add(s, torch.zeros(7, policy.cfg.hidden_size), version=0)
    assert buf.refresh(policy, version=1) == 7
    (entry,) = list(buf)
    assert entry.version == 1 and torch.equal(entry.features, sequence_features(policy, [s.token_ids])[0])
