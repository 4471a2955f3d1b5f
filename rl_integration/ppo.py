"""PPO: a small value head on the policy's hidden states, GAE, clipped value and policy losses.

The arithmetic (pure functions, tested against hand-computed values):
    token rewards  r_t = -beta (old_logp_t - ref_logp_t) at every token, plus the sample's
                   reward at its last token (the usual RLHF shaping; beta = trainer.kl_coef)
    GAE            delta_t = r_t + gamma V_{t+1} - V_t   (V after the last token = 0)
                   A_t = delta_t + gamma lam A_{t+1};    returns R_t = A_t + V_t
    value loss     0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)
    policy loss    the clipped-ratio loss of grpo.py with per-token advantages (whitened over
                   the rollout's tokens when ppo.whiten_advantages)
Both losses are aggregated with trainer.loss_agg. V_t is the value of the state before token t:
a linear head on the final hidden state at the position that predicts token t. With
ppo.value_trains_trunk false (the default) the value loss trains the head only, so a young
critic cannot disturb the policy's features.
"""
from __future__ import annotations

import torch
from torch import nn

from .grpo import GRPOTrainer, clipped_policy_loss, masked_aggregate
from .logprobs import pad_2d

# ------------------------------------------------------------------------------ arithmetic


def token_rewards(scores, mask, kl=None, kl_coef: float = 0.0) -> torch.Tensor:
    """[B, T]: -kl_coef * kl per token, plus scores[b] at the last valid token of row b."""
    mask = torch.as_tensor(mask, dtype=torch.float32)
    r = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        r = r - kl_coef * torch.as_tensor(kl, dtype=torch.float32) * mask
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rows = torch.arange(mask.shape[0])
    r[rows, last] += torch.as_tensor(scores, dtype=torch.float32) * (mask.sum(-1) > 0).float()
    return r


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 0.95):
    """(advantages, returns), both [B, T], zero past each row's last valid token."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    values = torch.as_tensor(values, dtype=torch.float32)
    mask = torch.as_tensor(mask, dtype=torch.float32)
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(b)
    next_adv = torch.zeros(b)
    for i in range(t - 1, -1, -1):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m
        # a padded position passes nothing back: the last valid token sees V = 0, A = 0 after it
        next_value = values[:, i] * m
        next_adv = a * m
    return adv, (adv + values) * mask


def whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the valid entries; zero elsewhere."""
    n = mask.sum().clamp(min=1.0)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * mask


def clipped_value_loss(values, old_values, returns, clip_eps: float):
    """Per-token 0.5 * max(unclipped, clipped) squared error, and where the clip was active."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    a = (values - returns) ** 2
    b = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(a, b), (b > a).float()


# ------------------------------------------------------------------------------ trainer


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)  # V = 0 at first: the early advantages are the rewards
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden):
        return self.linear(hidden.float()).squeeze(-1)


class PPOTrainer(GRPOTrainer):
    """PPO on a transformers causal LM plus a ValueHead (not part of the pushed weights)."""

    def __init__(self, model, cfg, temperature: float, top_k: int = 0, top_p: float = 1.0, pad_id: int = 0,
                 ref_model=None):
        self.value_head = ValueHead(model.config.hidden_size).to(next(model.parameters()).device)
        super().__init__(model, cfg, temperature, top_k, top_p, pad_id, ref_model)

    def parameters(self):
        return list(self.model.parameters()) + list(self.value_head.parameters())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "value_head": self.value_head.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("value_head") is None:
            raise ValueError("a PPO run resumes only from a checkpoint with a value head (value_head.pt)")
        self.value_head.load_state_dict(state["value_head"])
        super().load_state_dict(state)

    def advantages(self, batch, rewards) -> torch.Tensor:
        return torch.as_tensor(rewards, dtype=torch.float32)  # the step's scores; GAE makes advantages

    @torch.no_grad()
    def prepare(self, batch, scores) -> dict:
        """Old values, reference KL, GAE advantages and returns for the whole rollout."""
        n, t_max = len(batch), max(len(c) for c in batch.completion_ids)
        old = pad_2d(batch.logprobs, t_max)
        mask = pad_2d([[1.0] * len(c) for c in batch.completion_ids], t_max)
        values = torch.zeros(n, t_max)
        kl = torch.zeros(n, t_max)
        self.model.eval()
        for u0 in range(0, n, self.cfg.micro_batch_size):
            idx = list(range(u0, min(n, u0 + self.cfg.micro_batch_size)))
            _, m, h = self._forward(idx, batch, self.model, hidden=True)
            values[idx, :m.shape[1]] = (self.value_head(h) * m).cpu()
            if self.ref is not None and self.cfg.kl_coef > 0:
                ref, m, _ = self._forward(idx, batch, self.ref, hidden=False)
                kl[idx, :m.shape[1]] = ((old[idx, :m.shape[1]] - ref.cpu()) * m.cpu())
        p = self.cfg.ppo
        rewards = token_rewards(scores, mask, kl, self.cfg.kl_coef)
        adv, returns = gae(rewards, values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = whiten(adv, mask)
        return {"adv": adv, "returns": returns, "values": values, "mask": mask}

    def _active(self, prep, i: int) -> bool:
        return True  # the value loss needs every sample

    def sample_loss(self, batch, prep, idx, norm):
        lp, mask, h = self._forward(idx, batch, self.model, hidden=True)
        t = mask.shape[1]
        dev = lp.device
        old = pad_2d([batch.logprobs[i] for i in idx], t, device=dev)
        adv = prep["adv"][idx, :t].to(dev)
        pg, clipped = clipped_policy_loss(lp, old, adv, self.cfg.clip_eps, self.cfg.clip_eps_high)
        if not self.cfg.ppo.value_trains_trunk:
            h = h.detach()
        v = self.value_head(h)
        vf, vclipped = clipped_value_loss(v, prep["values"][idx, :t].to(dev), prep["returns"][idx, :t].to(dev),
                                          self.cfg.ppo.value_clip_eps)
        per_tok = pg + self.cfg.ppo.vf_coef * vf
        loss = masked_aggregate(per_tok, mask, self.cfg.loss_agg, **norm)
        info = {"clip": float((clipped * mask).sum()), "kl": 0.0,
                "diff": float(((lp.detach() - old).abs() * mask).sum()), "tokens": float(mask.sum()),
                "value_clip": float((vclipped * mask).sum())}
        return loss, info
