"""spectail's rollout engine: one process, no Ray. Exact coupled sampling, speculative
verification from any draft source, continuous batching over a static KV cache."""
from .threads import set_wait_policy

set_wait_policy()  # before torch loads OpenMP (rollout/threads.py)

from .config import Completion, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from .engine import Engine  # noqa: E402

__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecConfig", "Completion"]
