"""What tests/vllm share: a tiny demo policy vLLM's CPU attention can run (head size 32), a
local Ray of 2 CPUs, and a GRPO run that keeps each step's batch and the weights that made it.

Every vLLM engine start costs tens of seconds here, so engines are shared within a module."""
from __future__ import annotations

import copy

import pytest

from tests.rl_integration.conftest import TINY_RUN

# TINY_RUN's policy has 2 heads of 16 dimensions; vLLM's CPU attention needs a head size of 32 or more
VLLM_RUN = TINY_RUN + [
    "policy.embedded.num_heads=1", "policy.embedded.num_kv_heads=1",
    "rollout.name=vllm", "rollout.engine.spec=null", "rollout.vllm.compile=false",
    "trainer.steps=2", "output.plot=false",
]


@pytest.fixture(scope="session")
def vllm_run(tmp_path_factory):
    """Overrides for a tiny vLLM run whose policy is already in a session cache."""
    from rl_integration.config import load_config
    from rl_integration.trainer import load_policy

    overrides = VLLM_RUN + [f"policy.cache_dir={tmp_path_factory.mktemp('policy-cache')}"]
    load_policy(load_config(None, overrides), progress=False)
    return overrides


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed in this environment (`make venv-vllm` adds it)")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def train_and_keep(cfg, monkeypatch):
    """train(cfg), returning (records, each step's RolloutBatch, the state dict each was made with)."""
    from rl_integration.rollout_client import RolloutClient
    from rl_integration.trainer import load_policy, train

    batches, generate = [], RolloutClient.generate

    def keep(self, *args, **kwargs):
        batch = generate(self, *args, **kwargs)
        batches.append(batch)
        return batch

    monkeypatch.setattr(RolloutClient, "generate", keep)
    model = load_policy(cfg, progress=False)[0]
    weights = [copy.deepcopy(model.state_dict())]  # step s's rollout ran on weights[s]
    records = train(cfg, echo=lambda line: None,
                    on_step_end=lambda step, m: weights.append(copy.deepcopy(m.state_dict())) or {})
    return records, batches, weights, model


def logprob_error(model, weights: dict, batch, cfg) -> float:
    """Largest |engine logprob - the trainer's recomputed logprob| over the batch's tokens."""
    import torch

    from rl_integration.logprobs import pad_2d, token_logprobs

    model.load_state_dict(weights)
    r = cfg.rollout
    with torch.no_grad():
        lp, mask, _ = token_logprobs(model, batch.prompt_ids, batch.completion_ids, r.temperature, r.top_k, r.top_p)
    engine = pad_2d(batch.logprobs, mask.shape[1])
    return float(((lp - engine).abs() * mask).max())
