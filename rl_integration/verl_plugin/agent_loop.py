"""The agent loop "spectail_agent": verl's single-turn loop, with each request routed by its GRPO group.

verl's default single-turn loop (verl/experimental/agent_loop/single_turn_agent_loop.py) sends
every sample with a fresh uuid as request id, so verl's load balancer
(verl/workers/rollout/router.py, `GlobalRequestLoadBalancer`: sticky by request id, else least
loaded) scatters a group's siblings over the servers, and the server cannot tell which
requests are siblings. This loop is the same loop with its server client wrapped: every
request of a sample carries its group's `uid` (the trainer sets one per prompt before
repeating it n times, verl/trainer/ppo/ray_trainer.py) as request id, so the sticky session
sends the whole group to one server, and as `spectail_group`, which verl's client passes on to
the server's `generate` (verl/workers/rollout/llm_server.py, `LLMServerClient.generate`
forwards extra keywords). There the group meets in one engine run: siblings draft for each
other, and their seeds are sample indices 0..n-1 wherever the group lands.

    actor_rollout_ref.rollout.agent.default_agent_loop=spectail_agent
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
