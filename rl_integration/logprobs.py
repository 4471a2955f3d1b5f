"""The trainer's log-probabilities of sampled tokens, from the same processed distribution the
engine samples from (rollout.core.sampling.process_logits: z / T, then top-k and top-p), so ratios
against the engine's behaviour logprobs are exact. With top-k / top-p on, a sampled token the
trainer's own kept set drops gets about -1e4, not -inf: ratio 0 and gradient 0, not NaN.
"""
from __future__ import annotations

from typing import Sequence

import torch

from rollout.core.sampling import process_logits

MASKED_LOGIT = -1e4  # stands in for -inf: exp() of it is 0, and its gradient is finite


def collate(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
            device="cpu"):
    """Right-padded `prompt + completion[:-1]` (the last token is never an input), its attention
    mask, and for each completion token t the input position whose logits predict it.
    Returns (input_ids [B, L], attention_mask [B, L], index [B, T], mask [B, T] float)."""
    rows = [list(p) + list(c)[:-1] for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    t_max = max(len(c) for c in completions)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    index = torch.zeros((len(rows), t_max), dtype=torch.long)
    mask = torch.zeros((len(rows), t_max), dtype=torch.float32)
    for i, (r, p, c) in enumerate(zip(rows, prompts, completions)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, :len(r)] = 1
        index[i, :len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        mask[i, :len(c)] = 1.0
    return ids.to(device), attn.to(device), index.to(device), mask.to(device)


def pad_2d(rows: Sequence[Sequence[float]], width: int, value: float = 0.0, device="cpu") -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(list(r), dtype=torch.float32)
    return out.to(device)


def token_logprobs(model, prompts, completions, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   pad_id: int = 0, want_hidden: bool = False):
    """(logprobs [B, T], mask [B, T], hidden [B, T, d] or None) of each completion token under
    `model`, processed like the engine's sampling. Differentiable unless called under no_grad."""
    device = next(model.parameters()).device
    ids, attn, index, mask = collate(prompts, completions, pad_id, device)
    out = model(input_ids=ids, attention_mask=attn, output_hidden_states=want_hidden, use_cache=False)
    b, t = index.shape
    logits = torch.take_along_dim(out.logits, index[:, :, None], dim=1).float()  # [B, T, V]
    v = logits.shape[-1]
    n = b * t
    z = process_logits(logits.reshape(n, v),
                       torch.full((n,), float(temperature), device=device),
                       torch.full((n,), int(top_k), dtype=torch.long, device=device),
                       torch.full((n,), float(top_p), device=device))
    if top_k or top_p < 1:
        z = z.masked_fill(torch.isneginf(z), MASKED_LOGIT)
    targets = torch.zeros((b, t), dtype=torch.long, device=device)
    for i, c in enumerate(completions):
        targets[i, :len(c)] = torch.tensor(list(c), dtype=torch.long)
    lp = torch.log_softmax(z, dim=-1).gather(1, targets.reshape(n, 1)).reshape(b, t)
    hidden = None
    if want_hidden:
        h = out.hidden_states[-1]
        hidden = torch.take_along_dim(h, index[:, :, None], dim=1)
    return lp * mask, mask, hidden
