import rollout  # noqa: F401 -- first: OpenMP's wait policy is set before torch loads (rollout/threads.py)

# isort: split
import os
import subprocess
import sys

import pytest
import torch
import transformers

ARCH_CONFIGS = {
    "llama": lambda kw: transformers.LlamaConfig(**kw, tie_word_embeddings=False),
    "qwen2": lambda kw: transformers.Qwen2Config(**kw, tie_word_embeddings=True),
    "qwen3": lambda kw: transformers.Qwen3Config(**kw, head_dim=24),
    "mistral": lambda kw: transformers.MistralConfig(**kw, sliding_window=None),
}


def tiny_hf_model(arch: str = "llama", vocab: int = 101, seed: int = 0, dtype=torch.float32, **over):
    """A random transformers model of the given architecture, small enough for CPU tests."""
    kw = dict(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    kw.update(over)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(ARCH_CONFIGS[arch](kw))
    return model.to(dtype).eval()


def child_stdout(code: str, without=(), **env) -> str:
    """The last line a fresh Python prints running `code` in the repository root, with the
    environment variables `without` removed and `env` set (what spectail does at import)."""
    clean = {k: v for k, v in os.environ.items() if k not in without}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def llama_tiny():
    return tiny_hf_model("llama")


def pytest_terminal_summary(terminalreporter):
    from tests.fuzz_counts import summary_lines

    lines = summary_lines()
    if lines:
        terminalreporter.section("fuzz example counts")
        for line in lines:
            terminalreporter.write_line(line)
