"""spectail's rollout engine: one process, no Ray. Exact coupled sampling, speculative
verification from any draft source, continuous batching over a static KV cache."""
from .cpu_isa import cap_isa
from .threads import set_wait_policy

set_wait_policy()  # before torch loads OpenMP (rollout/threads.py)
cap_isa()  # before oneDNN makes its first kernel (rollout/cpu_isa.py)

from .config import Completion, EngineConfig, SamplingParams, SpecConfig  # noqa: E402
from .engine import Engine  # noqa: E402

__all__ = ["Engine", "EngineConfig", "SamplingParams", "SpecConfig", "Completion"]
