"""Training the draft head: soft cross-entropy to the policy's processed distribution of x_{j+2}
(the sample's own params, one-hot for T = 0), through the live lm_head from stored features.
Drafts are coupled samples of the same processing, so matching it maximises acceptance. Steps
s >= 1 feed each row the head's own output (training-time test), weighted step_decay ** s;
optional ReSpec weighting: a sample's rows weigh 1 + reward_beta * max(0, advantage).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from rollout.core import sampling, threads
from rollout.core.model import CausalLM

from .buffer import Entry
from .features import RowBatch, row_batch
from .head import DraftHead


@dataclass(frozen=True)
class TrainConfig:
    """decay "cosine": to lr / 20 over each call's time budget or max_steps (a warm start). ttt_steps:
    unrolled steps per row. batch_tokens: padded tokens per step. num_threads None: torch's as it is."""

    lr: float = 3e-3
    decay: str = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ttt_steps: int = 3
    step_decay: float = 0.8
    reward_beta: float = 0.0
    batch_tokens: int = 1024
    num_threads: Optional[int] = None
    seed: int = 0

    def validate(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.decay not in ("constant", "cosine"):
            raise ValueError(f"TrainConfig.decay must be 'constant' or 'cosine', got {self.decay!r}")
        if not (isinstance(self.ttt_steps, int) and self.ttt_steps >= 1):
            raise ValueError(f"TrainConfig.ttt_steps must be an integer >= 1, got {self.ttt_steps!r}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"TrainConfig.step_decay must be in (0, 1], got {self.step_decay}")
        if not self.reward_beta >= 0:
            raise ValueError(f"TrainConfig.reward_beta must be >= 0, got {self.reward_beta}")
        if self.batch_tokens < 2:
            raise ValueError(f"TrainConfig.batch_tokens must be >= 2, got {self.batch_tokens}")


@dataclass
class TrainState:
    """What persists between training calls: the head, its optimizer, the batch sampler."""

    head: DraftHead
    optimizer: torch.optim.Optimizer
    rng: random.Random
    steps: int = 0
    seconds: float = 0.0


def new_state(head: DraftHead, cfg: TrainConfig = TrainConfig()) -> TrainState:
    cfg.validate()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    return TrainState(head, opt, random.Random(cfg.seed))


def teacher(policy: CausalLM, head: DraftHead, rb: RowBatch, b: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """[M, V] the policy's processed distribution of x_{j+2} at rows (b, j), through the live lm_head."""
    with torch.no_grad():
        z = sampling.process_logits(head.full_logits(policy, rb.next_feats[b, j]), rb.temperature[b], rb.top_k[b],
                                    rb.top_p[b])
        probs = torch.softmax(z, dim=-1)
        greedy = rb.temperature[b] == 0
        if bool(greedy.any()):
            onehot = torch.zeros_like(probs).scatter_(1, z.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def batch_loss(head: DraftHead, policy: CausalLM, rb: RowBatch, cfg: TrainConfig) -> tuple[torch.Tensor, float]:
    """(the weighted soft cross-entropy over the unrolled steps, its KL part). The teacher's mass outside a
    draft vocabulary S is ignored: the optimum, p renormalised over S, lands a token with probability p(S)."""
    b0, j0 = rb.valid(0).nonzero(as_tuple=True)
    if b0.numel() == 0:
        raise ValueError("no training rows: every response is shorter than 3 tokens")
    probs = teacher(policy, head, rb, b0, j0)
    if head.draft_vocab is not None:
        probs = probs[:, head.draft_vocab.to(probs.device)]
    mass = probs.sum(-1).clamp_min(1e-30)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    where = torch.full(rb.tokens.shape, -1, dtype=torch.int64, device=rb.tokens.device)
    where[b0, j0] = torch.arange(b0.numel(), device=b0.device)
    t_eff = torch.where(rb.temperature > 0, rb.temperature, torch.ones_like(rb.temperature))
    total, kl, norm = 0.0, 0.0, 0.0
    for s, (out, _) in enumerate(head.unroll(policy, rb.tokens, rb.feats, cfg.ttt_steps, with_logits=False)):
        b, j = rb.valid(s).nonzero(as_tuple=True)
        if b.numel() == 0:
            break
        rows = where[b, j]
        # logits of the rows the loss reads only (a prompt's rows are keys, never drafts)
        logq = torch.log_softmax(head.logits(policy, out[b, j]) / t_eff[b, None], dim=-1)
        ce = -(probs[rows] * logq).sum(-1)
        w = rb.weight[b]
        step_w = cfg.step_decay ** s
        total = total + step_w * (w * ce).sum() / w.sum()
        row_kl = (ce - entropy[rows]) / mass[rows] - torch.log(mass[rows])
        kl += step_w * float(((w * row_kl).sum() / w.sum()).detach())
        norm += step_w
    return total / norm, kl / norm


def _pick_batch(entries: list[Entry], rng: random.Random, batch_tokens: int) -> list[Entry]:
    """Entries of similar length from a random place in the length order, up to batch_tokens padded."""
    order = sorted(entries, key=lambda e: e.num_tokens)
    i = rng.randrange(len(order))
    chosen = [order[i]]
    longest = order[i].num_tokens
    while len(chosen) < len(order):
        nxt = order[(i + len(chosen)) % len(order)]
        longest = max(longest, nxt.num_tokens)
        if longest * (len(chosen) + 1) > batch_tokens:
            break
        chosen.append(nxt)
    return chosen


def _set_lr(optimizer: torch.optim.Optimizer, cfg: TrainConfig, progress: float) -> None:
    lr = cfg.lr
    if cfg.decay == "cosine":
        lr = cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    for group in optimizer.param_groups:
        group["lr"] = lr


def train(state: TrainState, policy: CausalLM, entries: Iterable[Entry], cfg: TrainConfig = TrainConfig(),
          time_budget_s: float = 1.0, max_steps: Optional[int] = None,
          before_step: Optional[Callable[[list[Entry]], None]] = None,
          should_stop: Optional[Callable[[], bool]] = None) -> dict:
    """Optimizer steps on these entries until time_budget_s or max_steps; before_step(batch) runs
    before a batch is read, should_stop() True ends the call. loss in the result: the mean KL."""
    cfg.validate()
    state.head.check_policy(policy)
    entries = [e for e in entries if len(e.sample.response_ids) >= 2]
    start, steps, kls, tokens, stopped = time.perf_counter(), 0, [], 0, False
    if not entries:
        return {"steps": 0, "seconds": 0.0, "loss": None, "tokens": 0, "stopped": False}
    with threads.using(cfg.num_threads):
        while (max_steps is None or steps < max_steps) and time.perf_counter() - start < time_budget_s:
            if should_stop is not None and should_stop():
                stopped = True
                break
            chosen = _pick_batch(entries, state.rng, cfg.batch_tokens)
            if before_step is not None:
                before_step(chosen)
            weights = [1.0 + cfg.reward_beta * max(0.0, float(e.sample.advantage)) for e in chosen]
            rb = row_batch([e.sample for e in chosen], [e.features for e in chosen], weights,
                           device=state.head.fc.weight.device)
            loss, kl = batch_loss(state.head, policy, rb, cfg)
            progress = max((time.perf_counter() - start) / time_budget_s, steps / max_steps if max_steps else 0.0)
            _set_lr(state.optimizer, cfg, progress)
            state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(state.head.parameters(), cfg.max_grad_norm)
            state.optimizer.step()
            steps, tokens = steps + 1, tokens + sum(e.num_tokens for e in chosen)
            kls.append(kl)
    seconds = time.perf_counter() - start
    state.steps += steps
    state.seconds += seconds
    return {"steps": steps, "seconds": seconds, "loss": sum(kls) / len(kls) if kls else None,
            "last_loss": kls[-1] if kls else None, "tokens": tokens, "stopped": stopped}
