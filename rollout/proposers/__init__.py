"""Draft sources, by name. Each is a guesser: the engine verifies every draft token exactly.

The registry (rollout/config.py's PROPOSERS) names each class as "module:Class", imported only
when a SpecConfig asks for it (the drafter lives in a package `rollout` never imports), and built
with `Class.from_config(spec, model, engine_config)`.
"""
from __future__ import annotations

import importlib

from ..config import PROPOSERS as REGISTRY
from .base import Draft, Proposer


def make_proposers(spec, model=None, engine_config=None) -> list[Proposer]:
    """The proposers a SpecConfig names, in its order (None -> no speculation)."""
    if spec is None:
        return []
    return [_load(name).from_config(spec, model, engine_config) for name in spec.proposers]


def _load(name: str):
    if name not in REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; known: {list(REGISTRY)}")
    module, _, cls = REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"proposer {name!r} is not available ({REGISTRY[name]}: {e})") from None


__all__ = ["REGISTRY", "Draft", "Proposer", "make_proposers"]
