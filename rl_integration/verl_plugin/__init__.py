"""spectail as a verl (0.9.x) rollout backend: `actor_rollout_ref.rollout.name=spectail`.

verl picks a rollout backend by name from two registries and loads every `verl.plugins` entry
point when it is imported, in every process (verl/__init__.py). spectail's entry point,
`rl_integration.verl_plugin.register`, fills both:
  - the driver-side replica registry (verl/workers/rollout/replica.py, RolloutReplicaRegistry):
    "spectail" -> SpectailReplica (replica.py), which launches one SpectailServer actor per node;
  - the worker-side rollout class registry (verl/workers/rollout/base.py, _ROLLOUT_REGISTRY):
    ("spectail", "async") -> SpectailServerAdapter (adapter.py), through which verl's trainer
    workers push weights and release / resume memory;
and registers the agent loop "spectail_agent" (agent_loop.py), which routes a GRPO group to one
server. The server (server.py) batches concurrent requests into one engine run (batcher.py);
sampling.py maps verl's sampling parameters and derives the seeds; options.py reads the
`engine_kwargs.spectail` settings. docs/verl.md says how to turn it on.

Nothing here is imported unless verl is: this package is only loaded through verl.
"""
