"""The online drafter in the step loop: where its head comes from, and when it trains.

    drafter = online_drafter.start(cfg, folder, progress, prompts, eos)   # before the RolloutClient
    ... rollout, rewards
    stats = online_drafter.after_rollout(drafter, client, batch, rewards)   # before the optimizer steps
    ... optimizer steps, client.update_weights(model)
    stats.update(online_drafter.between_steps(drafter, client))            # local backend: train

`start` adds "drafter" to the engine's proposers with its first head: rollout.drafter.path, else
the policy's warm start (embedded: cached beside it; checkpoint: on its own samples of the task's
prompts, drafter/checkpoint_warm_start.py), else none. `between_steps` trains the local engine's
head within rollout.drafter.between_steps_s; Ray workers train in their idle time instead.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from rollout.config import DrafterSpec
from rollout.core import threads

from .config import RunConfig


@dataclass
class OnlineDrafter:
    cfg: DrafterSpec  # rollout.drafter; its path: the head the engines started from (or the warm start's)
    online: object  # drafter.online.OnlineState: the head's optimizer across steps
    seen: dict = field(default_factory=dict)  # the proposer's cumulative counters at the last report
    advantages: dict = field(default_factory=dict)  # seed -> advantage of the last rollout (reward weighting)


def start(cfg: RunConfig, policy_folder: Optional[str], progress: bool = True,
          prompts: Optional[Sequence[Sequence[int]]] = None,
          stop_token_ids: Sequence[int] = ()) -> Optional[OnlineDrafter]:
    """Turn the drafter on in cfg.rollout.engine (in place); None when off. prompts: for a warm start."""
    from drafter.online import OnlineState

    d, spec = cfg.rollout.drafter, cfg.rollout.engine.spec
    if not d.enabled or spec is None:
        return None
    if d.path is None and cfg.policy.source == "embedded" and policy_folder is not None:
        from .demo.policy import load_or_warm_start_drafter

        d = dataclasses.replace(d, path=load_or_warm_start_drafter(
            policy_folder, cfg.task.embedded, d.kind, d.warm_start_s, progress, window=d.window, layer=d.layer()))
    elif (d.path is None and cfg.policy.source == "checkpoint" and policy_folder is not None and d.warm_start_s > 0
          and prompts):
        d = dataclasses.replace(d, path=_checkpoint_warm_start(cfg, policy_folder, prompts, stop_token_ids, progress))
    proposers = spec.proposers if "drafter" in spec.proposers else (*spec.proposers, "drafter")
    cfg.rollout.engine = dataclasses.replace(
        cfg.rollout.engine, spec=dataclasses.replace(spec, proposers=proposers, drafter=d))
    cfg.rollout.engine.validate()
    return OnlineDrafter(d, OnlineState())


WARM_START_PROMPTS = 64  # task prompts the checkpoint's warm start samples (spread over the data set)


def _checkpoint_warm_start(cfg: RunConfig, policy_folder: str, prompts: Sequence[Sequence[int]],
                           stop_token_ids: Sequence[int], progress: bool) -> str:
    """The folder of a checkpoint policy's head warm-started on WARM_START_PROMPTS task prompts."""
    from drafter.checkpoint_warm_start import Recipe, load_or_warm_start_for
    from drafter.head import HeadConfig
    from rollout.core.model import CausalLM

    d = cfg.rollout.drafter
    policy = CausalLM.from_pretrained(policy_folder)
    chosen = list(prompts)[::max(1, len(prompts) // WARM_START_PROMPTS)][:WARM_START_PROMPTS]
    vocab = policy.cfg.vocab_size
    head_cfg = HeadConfig(kind=d.kind, window=d.window, **d.layer(),
                          draft_vocab=d.draft_vocab if d.draft_vocab is not None and d.draft_vocab < vocab else None)
    recipe = Recipe(max_tokens=min(cfg.rollout.max_tokens, 256), time_budget_s=d.warm_start_s)
    _, folder, _ = load_or_warm_start_for(policy, chosen, stop_token_ids, head_cfg, recipe,
                                          cache_dir=cfg.policy.cache_dir, num_threads=cfg.rollout.engine.num_threads,
                                          progress=progress)
    return str(folder)


def latest_head(drafter: Optional[OnlineDrafter], client) -> Optional[tuple[int, dict]]:
    """(version, head_state) of the newest head (local, published to Ray, or the first), for a checkpoint."""
    if drafter is None:
        return None
    from drafter.export import head_state, read_state

    proposer = _proposer(client)
    if proposer is not None:
        return (proposer.head_version, head_state(proposer.head)) if proposer.head is not None else None
    published = getattr(client.backend, "published_drafter", None)
    latest = published() if published is not None else None
    if latest is None and drafter.cfg.path is not None:
        state, version = read_state(drafter.cfg.path)
        latest = (version, state)
    return latest


def restore(drafter: Optional[OnlineDrafter], client, saved: Optional[tuple[int, dict]]) -> None:
    """A resumed run drafts with its checkpoint's head and version: loaded here, or published to Ray."""
    if drafter is None or saved is None:
        return
    version, state = saved
    proposer = _proposer(client)
    if proposer is not None:
        proposer.load(state, version)  # one that does not fit switches the drafter off, with a warning
    elif hasattr(client.backend, "publish_drafter"):
        client.backend.publish_drafter(state, version)


def _proposer(client):
    from drafter.proposer import DrafterProposer

    engine = getattr(client.backend, "engine", None)
    return DrafterProposer.of(engine) if engine is not None else None


def after_rollout(drafter: Optional[OnlineDrafter], client, batch, rewards) -> dict:
    """The drafter's figures of the rollout that just ran (local: also its simulated acceptance)."""
    if drafter is None:
        return {}
    from drafter.online import measure

    out: dict = {}
    proposer = _proposer(client)
    if proposer is not None:
        now = dict(proposer.stats)
        out = {f"drafter_{k}": v - drafter.seen.get(k, 0) for k, v in now.items()}
        drafter.seen = now
        with threads.using(threads.trainer_threads(None)):
            out.update(measure(proposer))
    elif hasattr(client.backend, "drafter_metrics"):
        out = client.backend.drafter_metrics()
    seconds = batch.step_stats.get("rollout_seconds") or 0.0
    if seconds > 0 and "drafter_seconds" in out:
        out["drafter_share"] = out["drafter_seconds"] / seconds
    if drafter.cfg.reward_beta > 0:
        from .grpo import group_advantages

        adv = group_advantages(rewards, batch.group_index).tolist()
        drafter.advantages = dict(zip(batch.seeds, adv))
    return out


def between_steps(drafter: Optional[OnlineDrafter], client) -> dict:
    """Local backend: train the engine's head for up to between_steps_s on its buffer. Ray: nothing."""
    if drafter is None:
        return {}
    from drafter.online import OnlineConfig, train_on_buffer

    proposer = _proposer(client)
    if proposer is None or drafter.cfg.between_steps_s <= 0:
        return {}
    cfg = OnlineConfig(proposer.spec, num_threads=threads.trainer_threads(None))
    return train_on_buffer(proposer, drafter.online, cfg, drafter.cfg.between_steps_s, drafter.advantages)
