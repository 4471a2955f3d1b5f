"""Random transformers models small enough for CPU tests (importable without configuring the
process, unlike tests/conftest.py)."""
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
