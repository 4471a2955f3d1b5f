"""The vLLM backend: vLLM's engine behind spectail's RolloutBackend, with its checkpoint, weights and config.

Importing it loads nothing else (not torch, not vllm); the names below load on first use."""
from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {"VllmBackend": ".backend", "engine_exit": ".backend", "import_vllm": ".backend",
            "sampled_speculation_problem": ".backend"}
__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
