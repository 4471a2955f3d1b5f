"""The agent loop "spectail_agent": verl's single-turn loop, each request routed by its GRPO group.

verl's own loop gives every sample a fresh request id, so its sticky load balancer scatters a
group over the servers. Here every request of a sample carries its group's `uid` as request id
(so the whole group reaches one server) and as `spectail_group`, which verl's client passes on to
the server: the group meets in one engine run, siblings draft for each other, and their seeds
are sample indices 0..n-1 wherever the group lands.
"""
from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class GroupRouted:
    """A verl LLMServerClient whose requests all carry one GRPO group."""

    def __init__(self, client, group: str):
        self._client, self._group = client, group

    async def generate(self, request_id=None, **kwargs):
        kwargs.setdefault("spectail_group", self._group)
        return await self._client.generate(request_id=f"spectail-group-{self._group}", **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@register("spectail_agent")
class SpectailAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params, **kwargs):
        uid = kwargs.get("uid")
        if uid is not None and not isinstance(self.server_manager, GroupRouted):
            self.server_manager = GroupRouted(self.server_manager, str(uid))
        return await super().run(sampling_params, **kwargs)
