"""Warm start: a draft head trained offline for a policy, from sampled sequences, before the first
RL step (when a drafter is needed most), the way the online trainer trains: same buffer, same loss.
"""
from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from rollout.core.model import CausalLM

from .buffer import FeatureBuffer
from .export import export, load
from .features import SavedRollout, sequence_features
from .head import DraftHead, HeadConfig
from .trainer import TrainConfig, TrainState, new_state, train


def warm_start(policy: CausalLM, rollouts: Sequence[SavedRollout], head_config: HeadConfig = HeadConfig(),
               train_config: TrainConfig = TrainConfig(decay="cosine"), time_budget_s: float = 60.0,
               max_steps: Optional[int] = None, head: Optional[DraftHead] = None,
               seed: int = 0, max_passes: Optional[float] = None,
               features: Optional[Sequence[Optional[torch.Tensor]]] = None) -> tuple[DraftHead, TrainState, dict]:
    """Train `head` (or a fresh float32 one) on these rollouts for time_budget_s, max_steps or max_passes,
    whichever ends first; features: those already made (None: the policy runs). -> (head, state, report)."""
    if not rollouts:
        raise ValueError("warm_start needs at least one rollout")
    t0 = time.perf_counter()
    feats = list(features) if features is not None else [None] * len(rollouts)
    if len(feats) != len(rollouts):
        raise ValueError(f"warm_start: {len(feats)} feature tensors for {len(rollouts)} rollouts")
    missing = [i for i, f in enumerate(feats) if f is None]
    if missing:
        with torch.no_grad():
            for i, f in zip(missing, sequence_features(policy, [rollouts[i].token_ids for i in missing])):
                feats[i] = f
    feature_seconds = time.perf_counter() - t0
    buffer = FeatureBuffer(sum(f.shape[0] for f in feats))
    for r, f in zip(rollouts, feats):
        if len(r.response_ids) >= 1:
            buffer.add(r, f, version=0)
    if head is None:
        head = DraftHead.for_policy(policy, head_config, dtype=torch.float32, seed=seed)
    state = new_state(head, train_config)
    if max_passes is not None:
        by_passes = steps_for_passes(buffer.total_tokens, max_passes, train_config)
        max_steps = by_passes if max_steps is None else min(max_steps, by_passes)
    report = train(state, policy, buffer, train_config, time_budget_s, max_steps)
    report.update(samples=len(buffer), buffer_tokens=buffer.total_tokens, feature_seconds=feature_seconds,
                  parameters=head.num_parameters(), kind=head.kind)
    return head, state, report


def steps_for_passes(tokens: int, passes: float, cfg: TrainConfig) -> int:
    """Optimizer steps that read `tokens` about `passes` times (batches hold batch_tokens)."""
    return max(1, math.ceil(passes * tokens / cfg.batch_tokens))


def load_or_warm_start(folder, policy: CausalLM, make_rollouts: Callable[[], Sequence[SavedRollout]],
                       head_config: HeadConfig = HeadConfig(), train_config: TrainConfig = TrainConfig(decay="cosine"),
                       time_budget_s: float = 60.0, max_steps: Optional[int] = None,
                       max_passes: Optional[float] = None) -> tuple[DraftHead, dict]:
    """The head exported in `folder`, else one warm-started on make_rollouts() and exported there
    (`load_cached`). Returns (head, report); report["cached"] says which happened."""
    cached = load_cached(folder, policy)
    if cached is not None:
        return cached, {"cached": True}
    head, _, report = warm_start(policy, make_rollouts(), head_config, train_config, time_budget_s, max_steps,
                                 max_passes=max_passes)
    export(head, folder)
    report["cached"] = False
    return head, report


def load_cached(folder, policy: CausalLM) -> Optional[DraftHead]:
    """The float32 head exported in `folder`; None when there is none, or with a warning when it
    does not load for this policy (it is trained over)."""
    folder = Path(folder)
    if not folder.exists():
        return None
    try:
        return load(folder, policy, dtype=torch.float32)
    except ValueError as e:
        warnings.warn(f"drafter warm start: retraining, the cached head does not load: {e}", stacklevel=3)
        return None
