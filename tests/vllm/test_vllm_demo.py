"""The demo's GRPO with rollout.name=vllm on one local vLLM engine: two steps, reward and
metrics written, the weights reach vLLM after each step, and vLLM's logprobs are the trainer's
(float32, within 1e-3) on the weights that sampled them. The Ray version is in test_vllm_ray.py."""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment: `make test-vllm` "
                    "creates .venv-vllm and runs tests/vllm there")

from rl_integration.config import load_config  # noqa: E402
from rl_integration.metrics import read_jsonl  # noqa: E402
from tests.vllm.conftest import logprob_error, train_and_keep  # noqa: E402


def test_demo_grpo_on_local_vllm(vllm_run, tmp_path, monkeypatch):
    cfg = load_config(None, vllm_run + [f"output.dir={tmp_path}"])
    records, batches, weights, model = train_and_keep(cfg, monkeypatch)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    for r in records:
        assert r["reward_mean"] is not None and 0.0 <= r["reward_mean"] <= 1.0
        assert r["generated_tokens"] > 0 and r["engine_steps"] > 0 and r["num_samples"] == 64
        assert r["weight_update_seconds"] > 0 and r["optimizer_steps"] > 0
    assert len(batches) == 2
    for step, batch in enumerate(batches):
        assert logprob_error(model, weights[step], batch, cfg) < 1e-3
    # step 1 sampled with the updated weights, not the initial ones
    assert logprob_error(model, weights[0], batches[1], cfg) > 1e-2
