"""spectail's rollout engine: one process, no Ray. Exact coupled sampling, speculative
verification from any draft source, continuous batching over a static KV cache.

Importing `rollout` loads nothing else (not torch): `rollout.cpu.configure()` can then run before
torch loads OpenMP (rollout/cpu.py). The names below load on first use."""
from __future__ import annotations

from .lazy import lazy_exports

_EXPORTS = {"Engine": ".core.engine", "EngineConfig": ".config", "SamplingParams": ".config",
            "SpecConfig": ".config", "Completion": ".config"}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
