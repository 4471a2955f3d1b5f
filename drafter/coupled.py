"""The drafter's coupled sampler: each draft token is argmax(processed head logits + G(seed, t, .)),
the token rollout.core.sampling.sample would pick, with less work: no processing at temperature 1
without top-k / top-p, no logprobs, the margin (best minus second-best score) from the same
scores, and off the CPU the noise made for a few draft positions at once. With a draft
vocabulary column i gets the noise of its real id vocab_ids[i].
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout.core import sampling
from rollout.kernels import noise_kernel, ops

from .vocab import keys32

# Noise is made for this many draft positions of the live requests at a time, while that holds
# at most NOISE_ELEMENTS elements (requests x positions x vocabulary).
NOISE_BLOCK = 4
NOISE_ELEMENTS = 1 << 22


class CoupledSampler:
    """For chains with .seed, .position (of their first draft), .k, .temperature, .top_k, .top_p.
    vocab_ids: the sorted ids the logits' columns stand for (None: all of vocab_size)."""

    def __init__(self, chains: Sequence, device, vocab_ids: Optional[torch.Tensor] = None,
                 vocab_size: Optional[int] = None):
        n = len(chains)
        ints = torch.tensor([int(c.seed) for c in chains] + [int(c.position) for c in chains]
                            + [int(c.top_k) for c in chains], dtype=torch.int64).to(device)
        self.seeds, self.first, self.top_k = ints[:n], ints[n:2 * n], ints[2 * n:]
        self.plain = all(float(c.temperature) == 1.0 and int(c.top_k) == 0 and float(c.top_p) == 1.0 for c in chains)
        if not self.plain:  # (only processed logits read them)
            floats = torch.tensor([float(c.temperature) for c in chains] + [float(c.top_p) for c in chains],
                                  dtype=torch.float32).to(device)
            self.temperature, self.top_p = floats[:n], floats[n:]
        self.greedy = [float(c.temperature) == 0 for c in chains]
        self.ks = [int(c.k) for c in chains]
        self.device = device
        self.ids, self.vocab_size = None, vocab_size
        if vocab_ids is not None:
            if vocab_size is None:
                raise ValueError("CoupledSampler: vocab_ids needs vocab_size (the policy's vocabulary)")
            self.ids = vocab_ids.to(device)
            self._keys32 = keys32(vocab_ids, vocab_size) if torch.device(device).type == "cpu" else None
        self._block: tuple = (-1, 0, {}, None)  # (first step, steps, chain -> its first row, noise [rows, V])

    def draft(self, logits: torch.Tensor, live: list[int], step: int, margins: bool,
              index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, list[int], list[float]]:
        """Tokens (a device tensor and a list of real ids) and margins (NaN unless asked) of chains `live`
        at their step-th position, from logits [len(live), V or |S|]; index: `live` on the device (None: all)."""
        tokens, gaps = self._columns(logits, live, step, margins, index)
        if self.ids is not None:
            tokens = self.ids[tokens]
        return tokens, tokens.tolist(), gaps

    def _columns(self, logits: torch.Tensor, live: list[int], step: int, margins: bool,
                 index: Optional[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
        """draft's tokens as column indices of `logits`, and its margins."""
        if index is None and len(live) != len(self.ks):
            index = torch.tensor(live).to(self.device)

        def pick(t):
            return t if index is None else t[index]

        z = logits if self.plain else sampling.process_logits(logits, pick(self.temperature), pick(self.top_k),
                                                              pick(self.top_p))
        kernel = ops.noise_library(z.device) if z.dtype == torch.float32 else None
        if kernel is not None and not any(self.greedy[i] for i in live):
            return self._fused(kernel, z, pick(self.seeds), pick(self.first) + step, margins)
        scores = z
        if not all(self.greedy[i] for i in live):
            scores = z + self._gumbel(live, step, z.shape[-1], index)
            if any(self.greedy[i] for i in live):
                greedy = torch.tensor([self.greedy[i] for i in live], device=self.device)
                scores = torch.where(greedy[:, None], z, scores)
        if not margins:
            return scores.argmax(dim=-1), [float("nan")] * len(live)
        best, tokens = scores.max(dim=-1)  # the first maximal index, as argmax
        if scores.shape[-1] < 2:
            return tokens, [float("inf")] * len(live)
        second = scores.scatter(1, tokens[:, None], float("-inf")).amax(dim=-1)
        return tokens, (best - second).tolist()

    def _fused(self, kernel, z: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
               margins: bool) -> tuple[torch.Tensor, list[float]]:
        """_columns' tokens and margins in one pass of the CPU noise kernel (the bits of z + gumbel_noise)."""
        gaps = torch.empty(z.shape[0], dtype=torch.float32) if margins else None
        keys = sampling.vocab_keys32(z.shape[-1]) if self.ids is None else self._keys32
        tokens = noise_kernel.perturbed_argmax(kernel, seeds, positions, keys, z.contiguous(), gaps)
        return tokens, gaps.tolist() if margins else [float("nan")] * z.shape[0]

    def _gumbel(self, live: list[int], step: int, vocab: int, index: Optional[torch.Tensor]) -> torch.Tensor:
        """G(seed, first + step, .) of the live chains: [len(live), V or |S|] float32, made for a block
        of positions of the chains live at its first one; index: `live` on the device (None: all)."""
        start, block, rows, noise = self._block
        if noise is None or not start <= step < start + block or any(i not in rows for i in live):
            reach = max(self.ks[i] for i in live) - step
            block = max(1, min(NOISE_BLOCK, reach, NOISE_ELEMENTS // max(1, len(live) * vocab)))
            seeds, positions = self.seeds, self.first + step
            if index is not None:
                seeds, positions = seeds[index], positions[index]
            if block > 1:
                seeds = seeds.repeat_interleave(block)
                steps = torch.arange(block, device=self.device).repeat(len(live))
                positions = positions.repeat_interleave(block) + steps
            start, rows = step, {i: n for n, i in enumerate(live)}
            noise = sampling.gumbel_noise(seeds, positions, vocab if self.ids is None else self.vocab_size, self.ids)
            noise = noise.view(len(live), block, vocab)
            self._block = (start, block, rows, noise)
        at = noise[:, step - start]
        if len(rows) == len(live):  # the same chains as at the block's start
            return at
        return at[torch.tensor([rows[i] for i in live]).to(self.device)]
