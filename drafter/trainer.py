"""Training the draft head: soft cross-entropy to the policy's processed distribution, unrolled.

For head row j (features h_j, token x_{j+1}) the teacher is the distribution the policy samples
x_{j+2} from: softmax(process_logits(lm_head(h_{j+1}), T, top-k, top-p)) with the sample's own
params (rollout/sampling.py; one-hot at its argmax for T = 0), recomputed through the live lm_head
from stored features. The head's drafts are coupled samples of softmax(u / T) over the same
processing, so matching this distribution is what maximises acceptance (Gumbel coupling lands a
token with probability >= (1 - TV) / (1 + TV)).

Training-time test: step s >= 1 feeds each row the head's own output of step s - 1 (as a draft
chain would see it) with loss weight step_decay ** s. Only rows that draft a response token count.
Optional reward weighting (ReSpec): a sample's rows weigh 1 + reward_beta * max(0, advantage).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from rollout import sampling, threads
from rollout.model import CausalLM

from .buffer import Entry
from .features import RowBatch, row_batch
from .head import DraftHead


@dataclass(frozen=True)
class TrainConfig:
    """lr, weight_decay, max_grad_norm: AdamW and clipping. decay: "constant" (online slices) or
    "cosine" (the learning rate falls to lr / 20 over each call's time budget or max_steps,
    whichever runs out first: a warm start, whose budget is its whole training). ttt_steps: unrolled steps per row.
    step_decay: loss weight of step s is step_decay ** s. reward_beta: ReSpec weighting (0 = off).
    batch_tokens: padded prompt + response tokens per optimizer step. num_threads: torch threads
    while training on a CPU (None: leave torch's setting). seed: which samples form each batch."""

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
    """(the weighted soft cross-entropy to optimise, its KL part: the KL of the teacher, restricted to
    the draft vocabulary and renormalised, to the head; 0 for a perfect head), over the unrolled steps.

    With a draft vocabulary S the teacher's mass outside S is ignored: the cross-entropy is
    -sum over v in S of p_v log q_v, whose optimum is q = p restricted to S and renormalised --
    the head that, under the shared Gumbel noise, lands a token exactly with probability p(S),
    the most any draft over S can. A row with little mass in S weighs little (it can hardly land)."""
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
    """Optimizer steps on these entries until time_budget_s has passed (checked before each
    step) or max_steps are done. before_step(batch): called with each step's entries before
    they are read (say to refresh their features). should_stop(): also checked before each
    step; True ends the call there, keeping the steps done (a Ray worker's slice gives the
    engine back to a chunk: scheduler/engine_turns.py). Returns {steps, seconds, loss (mean KL
    of these steps), tokens, stopped (should_stop ended it)}."""
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
