"""A tiny policy for the end-to-end tests: 1 layer, 32 wide, warm-started for 80 steps on
the embedded task at its smallest (start 0..4, count 1..2; about 30% right at T = 1), cached
once per test session. TINY_RUN is the one place that names TaskConfig / PolicyConfig fields."""
from __future__ import annotations

import importlib.util
import os

import pytest

TINY_RUN = [
    "task.embedded.min_start=0", "task.embedded.max_start=4", "task.embedded.min_count=1",
    "task.embedded.max_count=2", "task.embedded.num_problems=8", "task.embedded.seed=0",
    "policy.embedded.arch=llama", "policy.embedded.hidden_size=32", "policy.embedded.num_layers=1",
    "policy.embedded.num_heads=2",
    "policy.embedded.num_kv_heads=1", "policy.embedded.intermediate_size=64", "policy.embedded.sft_steps=80",
    "policy.embedded.sft_tokens_per_batch=512", "policy.embedded.sft_pool=512", "policy.embedded.lr=0.01",
    "policy.embedded.warmup_steps=2", "policy.embedded.num_threads=0",
    "rollout.max_tokens=24", "rollout.engine.max_model_len=64", "rollout.n=8",
    "trainer.prompts_per_step=8", "trainer.lr=1e-3", "trainer.update_epochs=2", "trainer.minibatch_size=32",
    "output.progress=false",
]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """Overrides for a tiny run whose policy is already in a session cache (trained here once)."""
    from rl_integration.config import load_config
    from rl_integration.trainer import load_policy

    cache = tmp_path_factory.mktemp("policy-cache")
    overrides = TINY_RUN + [f"policy.cache_dir={cache}"]
    load_policy(load_config(None, overrides), progress=False)
    return overrides


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs Ray (skipped cleanly when it is not installed)")


def load_example(file_name: str):
    """An examples/ script imported as a module (its `main` not run), for tests of its pieces."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", file_name)
    spec = importlib.util.spec_from_file_location(f"example_{file_name.removesuffix('.py')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
