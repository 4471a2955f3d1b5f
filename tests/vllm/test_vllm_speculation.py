"""vLLM's suffix speculation behind the backend: responses it generated earlier draft for a later
request of the same prompt (how last epoch's responses and GRPO siblings feed it), the tokens
stay the target's (greedy: the same as spectail's engine), and the per-request stats add up."""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: `make test-vllm` "
                    "creates .venv-vllm and runs tests/vllm there")
pytest.importorskip("arctic_inference", reason="arctic-inference (vLLM's suffix method) is not installed")

from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.vllm_backend import VllmBackend  # noqa: E402
from rollout.vllm_config import VllmConfig  # noqa: E402
from tests.conftest import tiny_hf_model  # noqa: E402
from tests.vllm.test_vllm_backend import CONFIG, PROMPTS, SHAPE  # noqa: E402


def test_suffix_cache_drafts_an_earlier_response_and_changes_no_greedy_token(tmp_path):
    model = tiny_hf_model("llama", seed=2, **SHAPE)
    model.save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    engine = Engine.from_pretrained(model, EngineConfig(max_batch_size=8, max_model_len=128))
    expected = [o.token_ids for o in engine.generate(PROMPTS, params, seeds=[0, 1, 2, 3])]
    backend = VllmBackend(tmp_path, CONFIG, VllmConfig(speculation="suffix", num_speculative_tokens=4, compile=False))
    try:
        first = backend.generate(PROMPTS, params, seeds=[0, 1, 2, 3])
        second = backend.generate(PROMPTS, params, seeds=[4, 5, 6, 7])  # "next epoch": same prompts
    finally:
        backend.shutdown()
    assert [o.token_ids for o in first] == expected and [o.token_ids for o in second] == expected
    for out in first + second:
        accepted = out.stats["accepted"].get("suffix", 0)
        assert 0 <= accepted <= out.stats["proposed"].get("suffix", 0)
        assert out.stats["forward_passes"] == len(out.token_ids) - 1 - accepted
    assert sum(o.stats["accepted"]["suffix"] for o in second) > sum(o.stats["accepted"].get("suffix", 0)
                                                                     for o in first)
    assert all(o.stats["forward_passes"] < len(o.token_ids) - 1 for o in second)
