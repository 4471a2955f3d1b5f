"""spectail as a verl (0.9.x) rollout backend: `actor_rollout_ref.rollout.name=spectail`
(docs/verl.md). The entry point `register.py` fills verl's driver-side replica registry
(replica.py: one SpectailServer per node, server.py) and worker-side rollout registry
(adapter.py: weight syncs and memory), and registers the agent loop "spectail_agent"
(agent_loop.py). batcher.py batches concurrent requests, sampling.py maps sampling parameters
and seeds, options.py reads `engine_kwargs.spectail`. Nothing here loads unless verl does.
"""
