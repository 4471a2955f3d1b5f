"""The drafter's coupled sampler: each draft token is argmax(processed head logits + G(seed, t, .)).

The same token rollout.sampling.sample would pick from these logits (z + G and z - log E are the
same IEEE value, and argmax takes the first index of a tie in both), so a head whose distribution
matches the policy's is accepted nearly always, and the offline simulation (drafter/simulate.py,
which calls rollout.sampling.sample) predicts the engine's drafts exactly. What differs is only
the work: the common case of temperature 1 without top-k / top-p skips the processing, the margin
(best minus second-best perturbed score: how far the head's logits would have to move to change
the token) comes from the same scores, and no logprobs are made (a draft needs none). On the CPU
one pass of the noise kernel per row gives the token and the margin together; elsewhere the
noise is made for a few draft positions of every live request at once (it depends on no logits:
one batch instead of one per position, and chains that end early do not pay for positions they
never reach), then added.

With a draft vocabulary (drafter/vocab.py) the logits' columns are the ids `vocab_ids` and
each column gets the noise of its real id, G(seed, t, vocab_ids[i]); the tokens returned are
real ids.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout import noise_kernel, ops, sampling

from .vocab import keys32, subset_gumbel

# Noise is made for this many draft positions of the live requests at a time, while that holds
# at most NOISE_ELEMENTS elements (requests x positions x vocabulary).
NOISE_BLOCK = 4
NOISE_ELEMENTS = 1 << 22


class CoupledSampler:
    """For chains with .seed, .position (of their first draft), .k, .temperature, .top_k, .top_p.
    vocab_ids: the draft vocabulary's ids (sorted) that the logits' columns stand for; None:
    the columns are the whole vocabulary. vocab_size: the policy's vocabulary (with vocab_ids)."""

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
        """Tokens (a device tensor and a list: real ids) and margins (NaN unless asked) of chains
        `live` at their step-th draft position; logits [len(live), V or |S|] float32, in the order
        of `live`; index: `live` as a device tensor (None: every chain is live)."""
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
        """_columns' tokens and margins in one pass of the CPU noise kernel, which makes each row's
        noise as it reads it (the same bits as z + gumbel_noise: rollout/noise_kernel.py)."""
        gaps = torch.empty(z.shape[0], dtype=torch.float32) if margins else None
        keys = sampling.vocab_keys32(z.shape[-1]) if self.ids is None else self._keys32
        tokens = noise_kernel.perturbed_argmax(kernel, seeds, positions, keys, z.contiguous(), gaps)
        return tokens, gaps.tolist() if margins else [float("nan")] * z.shape[0]

    def _gumbel(self, live: list[int], step: int, vocab: int, index: Optional[torch.Tensor]) -> torch.Tensor:
        """G(seed, first + step, .) of the live chains: [len(live), V or |S|] float32. Made for a block
        of positions of the chains live at its first one, no further than the longest chain;
        index: `live` as a device tensor, None when every chain is live."""
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
            noise = (sampling.gumbel_noise(seeds, positions, vocab) if self.ids is None
                     else subset_gumbel(seeds, positions, self.ids, self.vocab_size)).view(len(live), block, vocab)
            self._block = (start, block, rows, noise)
        at = noise[:, step - start]
        if len(rows) == len(live):  # the same chains as at the block's start
            return at
        return at[torch.tensor([rows[i] for i in live]).to(self.device)]
