"""spectail's rollout engine: one process, no Ray. Exact coupled sampling, speculative
verification from any draft source, continuous batching over a static KV cache.

Importing `rollout` loads nothing else (not torch): `rollout.cpu.configure()` can then run before
torch loads OpenMP (rollout/cpu.py). The names below load on first use."""
from __future__ import annotations

import importlib

_EXPORTS = {"Engine": ".engine", "EngineConfig": ".config", "SamplingParams": ".config",
            "SpecConfig": ".config", "Completion": ".config"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
