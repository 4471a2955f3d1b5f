"""The driver side: verl's RolloutReplica for spectail (verl/workers/rollout/replica.py).

One replica per device (spectail's engine runs on one). `launch_servers` starts one
SpectailServer actor per replica node, named as the worker-side adapter looks it up. Hybrid:
on its trainer worker's node, seeing that worker's GPU (as verl's vLLM replica does);
standalone: a GPU from Ray when the cluster has any, else the CPU. sleep / wake_up / abort are
the base class's: each calls the same method on every server.
"""
from __future__ import annotations

import asyncio

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .options import check_parallelism, server_options
from .server import SpectailServer

START_TIMEOUT_S = 600.0  # loading a large checkpoint onto a device


class SpectailReplica(RolloutReplica):
    def __init__(self, replica_rank, config, model_config, gpus_per_node: int = 8, is_reward_model: bool = False,
                 is_teacher_model: bool = False, name_suffix: str = ""):
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        check_parallelism(self.config)
        self.options = server_options(self.config)
        self.server_class = ray.remote(SpectailServer)

    async def init_standalone(self):
        """Standalone without a verl resource pool: the server actor asks Ray for what it needs."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    def server_name(self, node_rank: int) -> str:
        kind = "server_reward" if self.is_reward_model else "server_teacher" if self.is_teacher_model else "server"
        return f"spectail_{kind}_{self.replica_rank}_{node_rank}{self.name_suffix}"

    async def launch_servers(self):
        placements = await self._placements()
        for node_rank, (node_id, devices) in enumerate(placements):
            options = {"name": self.server_name(node_rank), "max_concurrency": self.max_concurrency,
                       "num_cpus": self.options.num_cpus}
            if node_id is not None:
                options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False)
            if devices:  # share the trainer worker's GPU: Ray must not reset the visible devices
                options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
            elif not self.workers and ray.cluster_resources().get("GPU", 0) > 0:
                options["num_gpus"] = 1
            self.servers.append(self.server_class.options(**options).remote(
                config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                workers=self.workers[node_rank:node_rank + 1], replica_rank=self.replica_rank, node_rank=node_rank,
                gpus_per_node=self.gpus_per_replica_node, nnodes=self.nnodes, cuda_visible_devices=devices))
        await self._wait_started()
        self._server_handle = self.servers[0]
        self._server_address = f"spectail-replica-{self.replica_rank}{self.name_suffix}"  # an id: no HTTP server

    async def _placements(self) -> list[tuple]:
        """(node id, CUDA_VISIBLE_DEVICES) per replica node: the trainer workers' in hybrid mode."""
        if not self.workers:
            return [(None, None)] * self.nnodes

        def where(worker_self):
            ctx = ray.get_runtime_context()
            gpus = ctx.get_accelerator_ids().get("GPU", [])
            return ctx.get_node_id(), ",".join(str(g) for g in gpus) or None

        infos = await asyncio.gather(*[w.__ray_call__.remote(where) for w in self.workers])
        per_node = self.gpus_per_replica_node
        return [infos[n * per_node] for n in range(self.nnodes)]

    async def _wait_started(self) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*[s.ready.remote() for s in self.servers]), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(f"spectail rollout servers of replica {self.replica_rank} did not start within "
                               f"{START_TIMEOUT_S:.0f}s (no node with the resources asked for?)") from None
        except Exception as e:
            raise RuntimeError(f"spectail rollout server of replica {self.replica_rank} failed to start: "
                               f"{type(e).__name__}: {e}. spectail must be installed (pip install spectail) in "
                               "every Ray worker's environment") from e
