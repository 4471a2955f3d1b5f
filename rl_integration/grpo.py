"""GRPO: group-normalised advantages and the clipped-ratio policy loss, with an optional KL to a
frozen reference policy. The arithmetic (pure functions, tested against hand-computed values):

    advantage_i = (r_i - mean_g) / (std_g + eps)      over the n samples of sample i's prompt
                  (unbiased std, as TRL's; scale=False: r_i - mean_g, Dr. GRPO; a group of one: 0)
    ratio_t     = exp(logp_t - old_logp_t)            old_logp: the engine's logprobs (logprobs.py)
    pg_t        = -min(ratio_t A, clip(ratio_t, 1 - eps_low, 1 + eps_high) A)
    kl_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3: unbiased, >= 0)
    loss        = aggregate(pg_t + beta kl_t)   "token_mean" (DAPO: every token weighs the same) or
                  "seq_mean" (original GRPO: every response weighs the same)

Micro-batching never changes the value: each micro-batch is divided by the minibatch's token
(or response) count. With kl_coef = 0 a sample of advantage 0 has no gradient, so it is not
even forwarded (it still counts in the normaliser).
"""
from __future__ import annotations

import copy
import time
from typing import Optional, Sequence

import torch

from .logprobs import pad_2d, token_logprobs

# ------------------------------------------------------------------------------ arithmetic


def group_advantages(rewards, group_index, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Per-sample advantage: reward minus its group's mean, divided by (std + eps) if scale."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(group_index, dtype=torch.long)
    if r.shape != g.shape or r.dim() != 1:
        raise ValueError(f"rewards {tuple(r.shape)} and group_index {tuple(g.shape)} must be equal 1-D shapes")
    _, g = torch.unique(g, return_inverse=True)
    k = int(g.max()) + 1 if len(g) else 0
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, g, r) / count
    dev = r - mean[g]
    var = torch.zeros(k, dtype=torch.float64).index_add_(0, g, dev * dev) / (count - 1).clamp(min=1)
    denom = var.sqrt()[g] + eps
    adv = torch.where(denom > 0, dev / denom.clamp(min=1e-300), torch.zeros_like(dev)) if scale else dev
    return adv.float()


def clipped_policy_loss(logp, old_logp, advantages, clip_low: float, clip_high: Optional[float] = None):
    """Per-token PPO-clip loss and a 0/1 tensor of where the clip was active.
    advantages broadcast against logp ([B, 1] per sequence, or [B, T] per token)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from samples of the policy."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def masked_aggregate(values, mask, mode: str = "token_mean", num_tokens: Optional[float] = None,
                     num_seqs: Optional[float] = None):
    """Reduce [B, T] per-token values to a scalar. num_tokens / num_seqs: the normaliser (the
    whole minibatch's count when this is one micro-batch of it); default: this batch's."""
    if mode == "token_mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (values * mask).sum() / max(float(denom), 1.0)
    if mode == "seq_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        denom = mask.shape[0] if num_seqs is None else num_seqs
        return per_seq.sum() / max(float(denom), 1.0)
    raise ValueError(f"loss aggregation must be 'token_mean' or 'seq_mean', got {mode!r}")


# ------------------------------------------------------------------------------ trainer


class GRPOTrainer:
    """Optimizer steps of GRPO on a transformers causal LM, from RolloutBatches.

    cfg: a TrainerSection. temperature / top_k / top_p: the rollout's sampling params (the
    trainer's logprobs use the same processed distribution). ref_model: the KL reference
    (default: a frozen copy of `model` as it is now, made only when cfg.kl_coef > 0).
    """

    def __init__(self, model, cfg, temperature: float, top_k: int = 0, top_p: float = 1.0, pad_id: int = 0,
                 ref_model=None):
        self.model, self.cfg = model, cfg
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, pad_id=pad_id)
        self.ref = ref_model
        if self.ref is None and cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.steps = 0

    def parameters(self):
        return list(self.model.parameters())

    def state_dict(self) -> dict:
        """What a resumed run's trainer needs besides the policy's weights: the optimizer's
        moments and step counts, and the optimizer-step counter (it seeds the minibatch order)."""
        return {"optimizer": self.opt.state_dict(), "scheduler": None, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def advantages(self, batch, rewards) -> torch.Tensor:
        return group_advantages(rewards, batch.group_index, scale=self.cfg.scale_rewards, eps=self.cfg.adv_eps)

    def step(self, batch, rewards: Sequence[float]) -> dict:
        """All optimizer steps for one rollout: update_epochs passes of shuffled minibatches."""
        start = time.perf_counter()
        adv = self.advantages(batch, rewards)
        prep = self.prepare(batch, adv)
        stats = self._updates(batch, prep)
        a, m = prep["adv"], prep.get("mask")
        stats["adv_abs_mean"] = float(a.abs().mean() if m is None else (a.abs() * m).sum() / m.sum().clamp(min=1.0))
        stats["train_seconds"] = time.perf_counter() - start
        return stats

    # GRPO: one advantage per sequence, broadcast over its tokens
    def prepare(self, batch, adv) -> dict:
        return {"adv": adv}

    def _active(self, prep, i: int) -> bool:
        # a zero-advantage sample contributes nothing but its KL term: skip its forward
        return self.cfg.kl_coef > 0 or float(prep["adv"][i]) != 0.0

    def _forward(self, idx, batch, model, hidden: bool = False):
        """token_logprobs of the samples `idx` under `model`, with the rollout's sampling params."""
        s = self.sampling
        return token_logprobs(model, [batch.prompt_ids[i] for i in idx], [batch.completion_ids[i] for i in idx],
                              s["temperature"], s["top_k"], s["top_p"], s["pad_id"], want_hidden=hidden)

    def sample_loss(self, batch, prep, idx, norm) -> tuple[torch.Tensor, dict]:
        """Loss of the samples `idx`, normalised by the minibatch's counts `norm`."""
        lp, mask, _ = self._forward(idx, batch, self.model)
        old = pad_2d([batch.logprobs[i] for i in idx], mask.shape[1], device=lp.device)
        adv = prep["adv"][idx].to(lp.device)[:, None]
        per_tok, clipped = clipped_policy_loss(lp, old, adv, self.cfg.clip_eps, self.cfg.clip_eps_high)
        kl = torch.zeros_like(per_tok)
        if self.ref is not None and self.cfg.kl_coef > 0:
            with torch.no_grad():
                ref, _, _ = self._forward(idx, batch, self.ref)
            kl = k3_kl(lp, ref)
        loss = masked_aggregate(per_tok + self.cfg.kl_coef * kl, mask, self.cfg.loss_agg, **norm)
        info = {"clip": float((clipped * mask).sum()), "kl": float((kl.detach() * mask).sum()),
                "diff": float(((lp.detach() - old).abs() * mask).sum()), "tokens": float(mask.sum())}
        return loss, info

    def _updates(self, batch, prep) -> dict:
        cfg = self.cfg
        n = len(batch)
        mb = cfg.minibatch_size or n
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.steps)
        self.model.train()
        sums: dict = {}
        losses, grad_norms, first_diff = [], [], None
        for _ in range(cfg.update_epochs):
            order = torch.randperm(n, generator=gen).tolist()
            for m0 in range(0, n, mb):
                mini = order[m0:m0 + mb]
                norm = {"num_tokens": float(sum(len(batch.completion_ids[i]) for i in mini)),
                        "num_seqs": float(len(mini))}
                active = [i for i in mini if self._active(prep, i)]
                if not active:
                    continue
                self.opt.zero_grad(set_to_none=True)
                mini_loss, diff, tok = 0.0, 0.0, 0.0
                for u0 in range(0, len(active), cfg.micro_batch_size):
                    loss, info = self.sample_loss(batch, prep, active[u0:u0 + cfg.micro_batch_size], norm)
                    loss.backward()
                    mini_loss += loss.item()
                    for k, v in info.items():
                        sums[k] = sums.get(k, 0.0) + v
                    diff, tok = diff + info["diff"], tok + info["tokens"]
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), cfg.max_grad_norm)))
                self.opt.step()
                self.steps += 1
                losses.append(mini_loss)
                if first_diff is None:
                    first_diff = diff / max(tok, 1.0)  # engine vs trainer logprobs, same weights
        self.model.eval()
        tokens = max(sums.pop("tokens", 0.0), 1.0)
        sums.pop("diff", None)
        out = {"loss": sum(losses) / max(len(losses), 1), "grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
               "logprob_diff": first_diff or 0.0, "optimizer_steps": len(losses)}
        names = {"clip": "clip_fraction", "kl": "kl", "value_clip": "value_clip_fraction"}
        out.update({names.get(k, k): v / tokens for k, v in sums.items()})
        return out
