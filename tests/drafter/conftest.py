import random

import pytest
import torch

from drafter.features import SavedRollout, sequence_features
from rollout import Engine, EngineConfig, SamplingParams
from rollout.core import threads
from rollout.core.model import CausalLM
from tests.conftest import tiny_hf_model

VOCAB = 101


def sharp_policy(seed: int = 3, scale: float = 6.0, arch: str = "llama", vocab: int = VOCAB,
                 dtype: torch.dtype = torch.float32, **over) -> CausalLM:
    """A tiny random policy whose output is sharpened (a random model's next-token distributions
    are nearly uniform, which every head matches)."""
    hf = tiny_hf_model(arch, vocab=vocab, seed=seed, **over)
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)
    return CausalLM.from_pretrained(hf, dtype)


def sample_rollouts(policy: CausalLM, n: int, seed: int, max_tokens: int = 40, params=None) -> list[SavedRollout]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    params = params or SamplingParams(temperature=1.0, max_tokens=max_tokens)
    engine = Engine(policy, EngineConfig(max_batch_size=16, max_model_len=128))
    outs = engine.generate(prompts, params, seeds=[seed * 1000 + i for i in range(n)])
    return [SavedRollout(p, o.token_ids, o.seed, params.temperature, params.top_k, params.top_p)
            for p, o in zip(prompts, outs)]


@pytest.fixture(scope="session")
def policy():
    return sharp_policy()


@pytest.fixture(scope="session")
def rollouts(policy):
    rolls = sample_rollouts(policy, 24, seed=1)
    return rolls, sequence_features(policy, [r.token_ids for r in rolls])


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: a second torch thread only adds wake-ups (rollout/core/threads.py)."""
    with threads.using(1):
        yield
