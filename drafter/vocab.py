"""The head's draft vocabulary S (EAGLE-3's, FR-Spec; docs/architecture.md, `vocab.py`): the
head's logits cover only the policy's lm_head rows of S, and the draft is argmax over v in S of
u_v / T + G(seed, t, v) with v the real id, the token a full-vocabulary draft would pick from
logits that are -inf outside S. S is sorted so that ties break as torch.argmax does; it selects
output rows, not weights, so it can be re-chosen without retraining.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

from rollout.core import sampling


def frequent_tokens(token_lists: Iterable[Sequence[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids of these sequences, sorted: [size] int64. Ties, and places left
    when fewer ids were seen, go to the lowest ids (a BPE tokenizer numbers common merges first)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}] (the policy's vocabulary), got {size}")
    counts = Counter(int(t) for seq in token_lists for t in seq)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token {bad[0]} lies outside the vocabulary [0, {vocab_size})")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    fill = (t for t in range(vocab_size) if t not in chosen)
    while len(ranked) < size:
        ranked.append(next(fill))
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def check_ids(ids: torch.Tensor, vocab_size: int, where: str = "draft vocabulary") -> None:
    """ValueError unless ids is a 1-D, strictly increasing int64 tensor of ids in [0, vocab_size)."""
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
        raise ValueError(f"{where}: needs a non-empty 1-D int64 tensor of token ids, "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{where}: ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: ids must be strictly increasing (sorted, no repeats); use drafter.vocab."
                         "frequent_tokens or torch.unique")


def keys32(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[|S|] int32 vocabulary keys of these ids for the CPU noise kernel (column i: G(seed, t, ids[i]))."""
    return sampling.vocab_keys32(vocab_size)[ids.cpu()].contiguous()


def expand(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., |S|] -> [..., V], -inf outside S: the logits a sub-vocabulary draft is equivalent to."""
    full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype, device=logits.device)
    full[..., ids.to(logits.device)] = logits
    return full
