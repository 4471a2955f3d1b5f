"""verl's entry point for spectail: importing this module registers it.

    [project.entry-points."verl.plugins"]
    spectail = "rl_integration.verl_plugin.register"

verl imports every `verl.plugins` entry point when verl itself is imported (verl/__init__.py,
VERL_USE_EXTERNAL_PLUGINS), in the driver and in every Ray worker, and swallows a plugin's
errors at debug level: a failure here is logged as a warning before it propagates, so that
"Unknown rollout mode: spectail" does not hide its cause.
"""
from __future__ import annotations

import logging

NAME = "spectail"
ADAPTER = "rl_integration.verl_plugin.adapter.SpectailServerAdapter"


def _replica_class():
    from .replica import SpectailReplica

    return SpectailReplica


def register() -> None:
    """The replica (driver side, verl/workers/rollout/replica.py RolloutReplicaRegistry), the
    rollout adapter (worker side, verl/workers/rollout/base.py _ROLLOUT_REGISTRY, by class path)
    and the "spectail_agent" agent loop."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _replica_class)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = ADAPTER
    try:
        from . import agent_loop  # noqa: F401 -- its @register("spectail_agent") fills verl's agent loop registry
    except ImportError as e:  # verl's agent loops need its "verl-core" extras (cachetools, uvicorn, ...)
        logging.getLogger(__name__).warning("spectail's agent loop 'spectail_agent' is not available: %s", e)


try:
    register()
except Exception as e:  # verl would log this at debug level only
    logging.getLogger(__name__).warning("spectail could not register as a verl rollout backend: %s: %s",
                                        type(e).__name__, e)
    raise
