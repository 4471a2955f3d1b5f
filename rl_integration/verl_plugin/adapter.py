"""The worker side: verl's BaseRollout for spectail (verl/workers/rollout/base.py), held by every
trainer worker of a hybrid engine and every checkpoint-engine worker. `resume(tags)` / `release()`
wake or free the server's weights and KV cache around a weight sync; `update_weights` iterates
verl's (name, tensor) generator on every rank (FSDP's gathers are collective) and the replica's
leader sends the tensors to its server, found by name as verl's vLLM adapter finds its own.
"""
from __future__ import annotations

import os
from typing import Optional

import ray
from verl.workers.rollout.base import BaseRollout

from .options import check_parallelism


class SpectailServerAdapter(BaseRollout):
    def __init__(self, config, model_config, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        check_parallelism(self.config)
        rank = int(os.environ.get("RANK", "0"))
        local_world_size = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
        self.replica_rank = rank if replica_rank == -1 else replica_rank  # one device per replica
        self.rollout_rank = 0
        self.node_rank = self.rollout_rank // max(1, local_world_size)
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle = None
        self.sleep_level = 2

    def _server(self):
        if self.server_handle is None:
            self.server_handle = ray.get_actor(f"spectail_server_{self.replica_rank}_{self.node_rank}")
        return self.server_handle

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().wake_up.remote(tags=list(tags))

    async def release(self):
        if self.config.free_cache_engine and self.is_leader_rank:
            await self._server().sleep.remote()

    async def update_weights(self, weights, global_steps: Optional[int] = None, wire_format: str = "named_tensors",
                             peft_config=None, base_sync_done: bool = True, **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        if wire_format != "named_tensors":
            raise ValueError(f"rollout.name=spectail takes full named tensors, got wire_format={wire_format!r}: "
                             "use a checkpoint_engine backend that sends full tensors")
        if peft_config is not None:
            raise ValueError("rollout.name=spectail loads full weights: set actor_rollout_ref.model.lora.merge=True "
                             "so verl merges the LoRA adapter before syncing")
        collected = {}
        async for name, tensor in ensure_async_iterator(weights):  # every rank iterates: gathers are collective
            if hasattr(tensor, "full_tensor"):  # a DTensor shard: the full tensor (collective)
                tensor = tensor.full_tensor()
            if self.is_leader_rank:
                collected[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader_rank:
            await self._server().update_weights.remote(ray.put(collected), global_steps=global_steps)
