"""What a run config says about vLLM when `rollout.name` is "vllm". The engine's shape stays in
`rollout.engine` (EngineConfig), whose `spec` must then be null: vLLM's speculation is chosen here.

    rollout:
      name: vllm
      engine: {spec: null, max_batch_size: 64, max_model_len: 1024, dtype: float32}
      vllm: {speculation: suffix, num_speculative_tokens: 4}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

SPECULATION_METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class VllmConfig:
    """python: the interpreter of Ray workers holding a vLLM engine (None: this one when it has
    vLLM, else the repository's .venv-vllm/bin/python); it must exist on every node."""

    # "ngram" (prompt lookup) or "suffix" (a suffix tree over every response the engine generated)
    speculation: Optional[Literal["ngram", "suffix"]] = None
    num_speculative_tokens: int = 4  # draft tokens verified per request per step
    kv_cache_gib: int = 1  # the CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.85
    compile: bool = True  # torch.compile and graphs (False: eager, a faster start)
    python: Optional[str] = None
    seed: int = 0  # vLLM's engine seed (each sample has its own per-request seed)

    def validate(self) -> None:
        if self.speculation is not None and self.speculation not in SPECULATION_METHODS:
            raise ValueError(f"VllmConfig.speculation must be null or one of {list(SPECULATION_METHODS)}, "
                             f"got {self.speculation!r} (spectail's own proposers do not run inside vLLM)")
        for name in ("num_speculative_tokens", "kv_cache_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"VllmConfig.{name} must be an integer >= 1, got {v!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"VllmConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.python is not None and not self.python.strip():
            raise ValueError("VllmConfig.python must be null or an interpreter path")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"VllmConfig.seed must be an integer in [0, 2**63), got {self.seed!r}")
