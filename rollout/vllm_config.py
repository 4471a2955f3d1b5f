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
    """speculation: None, "ngram" (prompt lookup) or "suffix" (arctic-inference's suffix tree over
        the prompt and every response the engine generated: GRPO siblings and last step's
        responses to the same prompt draft for each other).
    num_speculative_tokens: draft tokens verified per request per step.
    kv_cache_gib: the CPU KV cache (VLLM_CPU_KVCACHE_SPACE); unused on a GPU.
    gpu_memory_utilization: vLLM's share of each GPU; unused on the CPU.
    compile: torch.compile and graphs (False: eager, a faster start; tests use it).
    python: the interpreter Ray workers holding a vLLM engine run (runtime_env py_executable);
        None: this one when it can import vLLM, else the repository's .venv-vllm/bin/python
        (`make venv-vllm`). It must exist at that path on every node, with this Ray version.
    seed: vLLM's engine seed (each sample still has its own per-request seed).
    """

    speculation: Optional[Literal["ngram", "suffix"]] = None
    num_speculative_tokens: int = 4
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.85
    compile: bool = True
    python: Optional[str] = None
    seed: int = 0

    def validate(self) -> None:
        if self.speculation is not None and self.speculation not in SPECULATION_METHODS:
            raise ValueError(f"VllmConfig.speculation must be null or one of {list(SPECULATION_METHODS)}, "
                             f"got {self.speculation!r} (spectail's own proposers do not run inside vLLM)")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens < 1:
            raise ValueError(f"VllmConfig.num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        if isinstance(self.kv_cache_gib, bool) or not isinstance(self.kv_cache_gib, int) or self.kv_cache_gib < 1:
            raise ValueError(f"VllmConfig.kv_cache_gib must be an integer >= 1, got {self.kv_cache_gib!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"VllmConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.python is not None and not self.python.strip():
            raise ValueError("VllmConfig.python must be null or an interpreter path")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"VllmConfig.seed must be an integer in [0, 2**63), got {self.seed!r}")
