"""Bad input gets a ValueError that names the problem, and the engine stays usable."""
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from tests.conftest import tiny_hf_model


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained(tiny_hf_model("qwen2", vocab=64, seed=3),
                                  EngineConfig(max_batch_size=4, max_model_len=32, spec=SpecConfig()))


def reference(eng):
    return eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8), seeds=[1, 2])


@pytest.mark.parametrize("call, message", [
    (lambda e: e.generate([[]]), "prompt 0 is empty"),
    (lambda e: e.generate([[1], list(range(1, 33))]), "prompt 1 has 32 tokens; max_model_len is 32"),
    (lambda e: e.generate([[1, 64]]), "token id 64 outside the vocabulary"),
    (lambda e: e.generate([[1, -1]]), "token id -1 outside the vocabulary"),
    (lambda e: e.generate([[1]], SamplingParams(temperature=-0.5)), "temperature must be 0 \\(greedy\\) or in"),
    (lambda e: e.generate([[1]], SamplingParams(top_p=0.0)), r"top_p must be in \(0, 1\]"),
    (lambda e: e.generate([[1]], SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\]"),
    (lambda e: e.generate([[1]], SamplingParams(max_tokens=0)), "max_tokens must be an integer >= 1"),
    (lambda e: e.generate([[1]], SamplingParams(top_k=-1)), "top_k must be an integer >= 0"),
    (lambda e: e.generate([[1], [2]], seeds=[1]), "seeds has 1 entries for 2 prompts"),
    (lambda e: e.generate([[1]], seeds=[-3]), r"seeds\[0\] must be an integer in \[0, 2\*\*63\)"),
    (lambda e: e.generate([[1]], seeds=[2**63]), r"seeds\[0\] must be an integer"),
    (lambda e: e.generate([[1]], [SamplingParams()] * 2), "sampling_params has 2 entries for 1 prompts"),
    (lambda e: e.generate([[1]], drafts=[[1, 99]]), r"drafts\[0\] has token id 99"),
    (lambda e: e.generate([[1]], SamplingParams(stop_token_ids=[70])), "stop_token_ids has 70"),
])
def test_bad_generate_input(eng, call, message):
    before = reference(eng)
    with pytest.raises(ValueError, match=message):
        call(eng)
    after = reference(eng)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


def weights(eng):
    return {k: v.clone() for k, v in eng.model.state_dict().items()}


@pytest.mark.parametrize("update, message", [
    (lambda sd: {"model.layers.0.self_attn.q_proj.wieght": sd["model.layers.0.self_attn.q_proj.weight"]},
     "unknown parameter 'model.layers.0.self_attn.q_proj.wieght'"),
    (lambda sd: {"model.norm.weight": torch.ones(3)}, r"'model.norm.weight' has shape \(3,\), expected"),
    (lambda sd: {"model.norm.weight": torch.ones_like(sd["model.norm.weight"], dtype=torch.int64)},
     "'model.norm.weight' has dtype torch.int64"),
    (lambda sd: {"model.layers.1.mlp.up_proj.weight": torch.zeros_like(sd["model.norm.weight"]).new_full(
        sd["model.layers.1.mlp.up_proj.weight"].shape, float("nan"))}, "contains NaN"),
    # a good tensor first, then a bad one: nothing of the update may land
    (lambda sd: [("model.norm.weight", sd["model.norm.weight"] * 2), ("bogus", sd["model.norm.weight"])],
     "unknown parameter 'bogus'"),
])
def test_bad_weight_update_changes_nothing(eng, update, message):
    before_w, before = weights(eng), reference(eng)
    with pytest.raises(ValueError, match=message):
        eng.update_weights(update(eng.model.state_dict()))
    for k, v in weights(eng).items():
        assert torch.equal(v, before_w[k]), k
    assert [o.token_ids for o in reference(eng)] == [o.token_ids for o in before]


@pytest.mark.parametrize("cfg, message", [
    (EngineConfig(max_batch_size=0), "max_batch_size must be >= 1"),
    (EngineConfig(dtype="float8"), "dtype must be one of"),
    (EngineConfig(spec=SpecConfig(proposers=("magic",))), r"unknown \['magic'\]"),
    (EngineConfig(spec=SpecConfig(max_draft_tokens=0)), "max_draft_tokens must be >= 1"),
])
def test_bad_config(cfg, message):
    with pytest.raises(ValueError, match=message):
        cfg.validate()
