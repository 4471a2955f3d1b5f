"""Training the drafter online, on the rollouts its own engine just ran.

The drafter proposer leaves every finished or paused response in its buffer with the policy's
hidden states: no extra forward under the current weights; older entries are recomputed just
before a training step reads them (`FeatureBuffer.refresh`). The local backend trains between
steps (rl_integration/online_drafter.py), a Ray worker with no chunk in idle slices
(scheduler/worker.py). Each call hands the engine the trained head under a new version.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rollout.config import DrafterSpec

from .head import DraftHead, HeadConfig
from .proposer import DrafterProposer
from .simulate import simulated_acceptance
from .trainer import TrainConfig, TrainState, new_state, train
from .warm_start import steps_for_passes


@dataclass(frozen=True)
class OnlineConfig:
    """drafter: the engine's DrafterSpec. max_passes: a call stops after reading its data about this
    many times (more would only fit the head to these few responses)."""

    drafter: DrafterSpec = DrafterSpec()
    batch_tokens: int = 1024
    num_threads: Optional[int] = None
    seed: int = 0
    max_passes: float = 2.0

    def head_config(self) -> HeadConfig:
        return HeadConfig(kind=self.drafter.kind, window=self.drafter.window, **self.drafter.layer())

    def train_config(self) -> TrainConfig:
        d = self.drafter
        cfg = TrainConfig(lr=d.lr, ttt_steps=d.ttt_steps, reward_beta=d.reward_beta, batch_tokens=self.batch_tokens,
                          num_threads=self.num_threads, seed=self.seed)
        cfg.validate()
        return cfg


@dataclass
class OnlineState:
    """What persists between training calls on one engine: the optimizer of the head it trains."""

    train: Optional[TrainState] = None


def measure(proposer: DrafterProposer, max_samples: int = 32, max_k: int = 8) -> dict:
    """Simulated acceptance of the head on its buffer's newest rollout: call it before the weights move."""
    if proposer.head is None or proposer.buffer is None:
        return {}
    entries = [e for e in proposer.buffer if e.version == proposer.policy_version and e.finished
               and len(e.sample.response_ids) >= 2][-max_samples:]
    if not entries:
        return {}
    sim = simulated_acceptance(proposer.head, proposer.model, [e.sample for e in entries], max_k,
                               features=[e.features for e in entries])
    return {"drafter_sim_acceptance": sim["per_token_acceptance"],
            "drafter_sim_first_token": sim["first_token_acceptance"],
            "drafter_sim_tokens_per_forward": sim["by_k"][max_k]["tokens_per_forward"],
            "drafter_sim_samples": len(entries)}


def train_on_buffer(proposer: DrafterProposer, online: OnlineState, cfg: OnlineConfig, budget_s: float,
                    advantages: Optional[dict] = None, current_only: bool = False,
                    should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Train the engine's head (a fresh one if it has none) on its buffer for up to budget_s, then
    set it as the next version. advantages: {seed: advantage} for reward weighting. current_only:
    only entries of the current policy version (no recomputed features). should_stop: checked
    between optimizer steps. Returns the drafter_* metrics."""
    start = time.perf_counter()
    buf = proposer.buffer
    if buf is None:
        return {}
    head = proposer.head or (online.train.head if online.train is not None else DraftHead.for_policy(
        proposer.model, cfg.head_config(), dtype=torch.float32, seed=cfg.seed))
    tcfg = cfg.train_config()
    if online.train is None or online.train.head is not head:
        online.train = new_state(head, tcfg)
    for seed, adv in (advantages or {}).items():
        e = buf.get(seed)
        if e is not None:
            e.sample = dataclasses.replace(e.sample, advantage=float(adv))
    entries = [e for e in buf if not current_only or e.version == proposer.policy_version]
    refreshed = [0]

    def refresh(batch):
        refreshed[0] += buf.refresh(proposer.model, proposer.policy_version, batch)

    budget = max(0.0, budget_s - (time.perf_counter() - start))
    max_steps = steps_for_passes(sum(e.num_tokens for e in entries), cfg.max_passes, tcfg)
    report = train(online.train, proposer.model, entries, tcfg, budget, max_steps, before_step=refresh,
                   should_stop=should_stop)
    if report["steps"]:
        try:
            proposer.set_head(head, proposer.head_version + 1)
        except ValueError as e:  # training diverged: no drafts from it
            proposer.switch_off(f"the trained head is unusable: {e}")
            online.train = None
    return {"drafter_train_steps": report["steps"], "drafter_train_seconds": time.perf_counter() - start,
            "drafter_train_loss": report["loss"], "drafter_refreshed_tokens": refreshed[0],
            "drafter_version": proposer.head_version, "drafter_train_stopped": report["stopped"]}
