"""The in-process rollout backend keeps the RolloutBackend contract: the engine's completions,
its metrics, all-or-nothing weight updates; and tail_seconds, the one definition of the tail."""
import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams, SpecConfig
from rollout.backend import LocalBackend, RolloutBackend, tail_seconds
from tests.conftest import tiny_hf_model


def test_tail_seconds():
    assert tail_seconds([]) == 0.0
    assert tail_seconds([1.0] * 10) == 0.0
    assert tail_seconds([5.0]) == 0.0
    assert tail_seconds([float(i) for i in range(1, 10)] + [30.0]) == 21.0  # 90% done at 9 s, all at 30 s
    assert tail_seconds([1.0] * 18 + [5.0, 3.0]) == pytest.approx(4.0)
    assert tail_seconds([1.0, 2.0, 3.0, 5.0]) == 0.0  # 90% of 4 samples is all 4


def test_local_backend_is_the_engine_with_metrics():
    hf = tiny_hf_model("llama", vocab=101, seed=3)
    cfg = EngineConfig(max_batch_size=3, max_model_len=64, spec=SpecConfig(proposers=("ngram", "suffix")))
    backend = LocalBackend(hf, cfg)
    assert isinstance(backend, RolloutBackend)
    prompts, params = [[1, 2, 3, 1, 2, 3], [4, 5], [6, 7, 8]], SamplingParams(max_tokens=20)
    outs = backend.generate(prompts, params, seeds=[1, 2, 3], groups=[0, 0, 1])
    ref = Engine.from_pretrained(hf, EngineConfig(max_batch_size=3, max_model_len=64)).generate(
        prompts, params, seeds=[1, 2, 3])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    m = backend.metrics()
    assert m["engine_steps"] >= 20 and 0 <= m["tail_seconds"] <= m["rollout_seconds"]
    assert m["fed_tokens"] >= sum(map(len, prompts)) + 3 * 19
    with pytest.raises(ValueError, match="unknown parameter"):
        backend.update_weights({"nope": torch.zeros(1)})
    assert [o.token_ids for o in backend.generate(prompts, params, seeds=[1, 2, 3])] == [o.token_ids for o in ref]
    backend.shutdown()
