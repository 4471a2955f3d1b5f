"""Kept KV slots: a paused request's keys and values, held by the engine between runs in a bounded
side cache under the caller's key with the tokens they were computed from, so the same request
continues here without prefilling them again (docs/architecture.md, `kept_slots.py`). The KV at
position p depends on the weights and tokens 0..p alone: only update_weights makes an entry stale.
A side cache, not extra engine slots, keeps running requests in the lowest contiguous slots.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch

from .kv_cache import KVCache
from .request import Request


@dataclass
class Kept:
    """A side-cache slot holding the KV of tokens[:length]."""

    slot: int
    tokens: list[int]
    length: int


class KeptSlots:
    """The engine's store of kept KV (capacity 0: keeps nothing, every call is a no-op)."""

    def __init__(self, new_cache: Callable[[int], KVCache], capacity: int):
        self.capacity = capacity
        self.store = new_cache(capacity) if capacity > 0 else None
        self.entries: OrderedDict[Hashable, Kept] = OrderedDict()  # least recently kept first
        self.free = list(range(capacity))
        self.counts = {"kept": 0, "resumed": 0, "resumed_tokens": 0, "evicted": 0, "mismatched": 0}

    def keys(self) -> list:
        return list(self.entries)

    def clear(self) -> None:
        """Forget every entry (weights changed: their KV is stale)."""
        self.drop(lambda key: True)

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the entries whose key `which` selects."""
        for key in [k for k in self.entries if which(k)]:
            self.free.append(self.entries.pop(key).slot)

    def begin(self, requests: Sequence[Request], keys: Sequence[Optional[Hashable]]) -> KeptRun:
        """One run's use of the store: each request's entry whose tokens its context still begins with is
        claimed (one that does not match is dropped); only the run's `close` gives a claim back."""
        check_keys(keys, len(requests))
        run = KeptRun(self)
        for req, key in zip(requests, keys):
            if key is None or req.finish_reason is not None or key not in self.entries:
                run.keys[id(req)] = key
                continue
            entry = self.entries.pop(key)
            n = min(entry.length, req.num_tokens - 1)  # at least one token left to feed: its logits
            if n > 0 and entry.tokens[:n] == req.all_ids[:n]:
                run.claims[id(req)] = Kept(entry.slot, entry.tokens, n)
            else:
                self.counts["mismatched"] += 1
                self.free.append(entry.slot)
            run.keys[id(req)] = key
        return run

    def _keep(self, key: Hashable, req: Request, cache: KVCache) -> None:
        n = min(req.num_cached, req.num_tokens)
        if self.store is None or n <= 0:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.free.append(old.slot)
        if not self.free:
            if not self.entries:  # every side slot is claimed by this run: nothing to evict
                return
            _, evicted = self.entries.popitem(last=False)
            self.free.append(evicted.slot)
            self.counts["evicted"] += 1
        slot = self.free.pop()
        copy_positions(cache, req.slot, self.store, slot, n)
        self.entries[key] = Kept(slot, req.all_ids[:n], n)
        self.counts["kept"] += 1


class KeptRun:
    """What one `Engine.run` claimed from the store and under which keys it keeps its requests."""

    def __init__(self, kept: KeptSlots):
        self.kept = kept
        self.keys: dict[int, Optional[Hashable]] = {}  # id(request) -> its key
        self.claims: dict[int, Kept] = {}  # id(request) -> its entry, until admitted

    def admit(self, req: Request, cache: KVCache) -> None:
        """req was given engine slot req.slot: restore its kept KV there, if it has some."""
        entry = self.claims.pop(id(req), None)
        if entry is None:
            return
        copy_positions(self.kept.store, entry.slot, cache, req.slot, entry.length)
        req.num_cached = entry.length
        self.kept.free.append(entry.slot)
        self.kept.counts["resumed"] += 1
        self.kept.counts["resumed_tokens"] += entry.length

    def pause(self, req: Request, cache: KVCache) -> None:
        """req paused and is leaving its engine slot: keep its KV under its key, if it has one."""
        key = self.keys.get(id(req))
        if key is not None:
            self.kept._keep(key, req, cache)

    def close(self) -> None:
        """The run is over: claims never admitted go back to the store as they were."""
        for rid, entry in self.claims.items():
            key = self.keys[rid]
            if key in self.kept.entries:  # (a newer entry under the same key won)
                self.kept.free.append(entry.slot)
            else:
                self.kept.entries[key] = entry
        self.claims.clear()


def check_keys(keys, n: int) -> None:
    """keys: one per request, each hashable or None, no key twice; else a ValueError naming it."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or len(keys) != n:
        raise ValueError(f"keep must be a sequence of one key (or None) per request ({n}), got {keys!r:.80}")
    seen = set()
    for i, key in enumerate(keys):
        if key is None:
            continue
        try:
            if key in seen:
                raise ValueError(f"keep[{i}] = {key!r} is given twice: each request needs its own key")
        except TypeError:
            raise ValueError(f"keep[{i}] = {key!r} is not hashable: keys must be hashable (or None)") from None
        seen.add(key)


def copy_positions(src: KVCache, src_slot: int, dst: KVCache, dst_slot: int, length: int) -> None:
    """Keys and values of positions [0, length) of one slot into another cache's slot (every layer)."""
    with torch.inference_mode():
        for from_layer, to_layer in zip(src.prefixes(length), dst.prefixes(length)):
            for s, d in zip(from_layer, to_layer):
                d[dst_slot].copy_(s[src_slot])
