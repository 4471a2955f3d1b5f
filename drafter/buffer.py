"""The drafter's training data: a ring of responses bounded by a token budget.

Each entry is one response (finished, or in flight and replaced as it grows, under its key) with
the policy's hidden state at every position and the policy version that made them. Only features
are stored: the trainer recomputes each teacher through the live lm_head, so only the features go
stale, which `refresh` recomputes. Adding past the budget drops the oldest entries first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Optional

import torch

from rollout.core.model import CausalLM

from .features import SavedRollout, sequence_features


@dataclass
class Entry:
    sample: SavedRollout
    features: torch.Tensor  # [len(prompt) + len(response), d]
    version: int
    finished: bool = True

    @property
    def num_tokens(self) -> int:
        return self.features.shape[0]


class FeatureBuffer:
    """max_tokens: the budget (prompt + response tokens over all entries). dtype: how features
    are stored (None: as given; bfloat16 halves the memory of float32 features)."""

    def __init__(self, max_tokens: int, dtype: Optional[torch.dtype] = None):
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"FeatureBuffer.max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.max_tokens, self.dtype = max_tokens, dtype
        self.total_tokens = 0
        self._entries: OrderedDict = OrderedDict()  # key -> Entry, oldest first
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def add(self, sample: SavedRollout, features: torch.Tensor, version: int, finished: bool = True,
            key: Optional[Hashable] = None) -> None:
        """Store a response's features (checked first), evicting the oldest entries beyond the
        budget; a key already present is replaced and becomes the newest."""
        n = len(sample.prompt_ids) + len(sample.response_ids)
        if features.dim() != 2 or features.shape[0] != n:
            raise ValueError(f"features must be [{n}, hidden] for a sample of {n} tokens, got {tuple(features.shape)}")
        if len(sample.response_ids) < 1 or len(sample.prompt_ids) < 1:
            raise ValueError("a buffer entry needs at least one prompt and one response token")
        if n > self.max_tokens:
            raise ValueError(f"a sample of {n} tokens does not fit a buffer of {self.max_tokens} tokens")
        if not bool(torch.isfinite(features).all()):
            raise ValueError("features contain NaN or Inf")
        if key is None:
            key, self._next_key = ("auto", self._next_key), self._next_key + 1
        if key in self._entries:
            self.total_tokens -= self._entries.pop(key).num_tokens
        stored = features.detach().to(self.dtype) if self.dtype is not None else features.detach()
        self._entries[key] = Entry(sample, stored, int(version), finished)
        self.total_tokens += n
        while self.total_tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self.total_tokens -= old.num_tokens

    def get(self, key: Hashable) -> Optional[Entry]:
        return self._entries.get(key)

    def versions(self) -> dict[int, int]:
        """policy version -> tokens stored under it."""
        out: dict[int, int] = {}
        for e in self._entries.values():
            out[e.version] = out.get(e.version, 0) + e.num_tokens
        return out

    def refresh(self, policy: CausalLM, version: int, entries: Optional[Iterable[Entry]] = None) -> int:
        """Recompute the features of entries (all, or `entries`) older than `version` under the
        policy's current weights; returns how many tokens were recomputed."""
        pool = self._entries.values() if entries is None else entries
        stale = [e for e in pool if e.version < version]
        if not stale:
            return 0
        fresh = sequence_features(policy, [e.sample.token_ids for e in stale])
        for e, f in zip(stale, fresh):
            e.features, e.version = f.to(device=e.features.device, dtype=e.features.dtype), int(version)
        return sum(e.num_tokens for e in stale)

    def clear(self) -> None:
        self._entries.clear()
        self.total_tokens = 0
