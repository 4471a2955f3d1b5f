"""Running requests kept in KV-cache slots ordered by context bucket.

Attention groups rows by context bucket (rollout/core/batch.py); a group in consecutive slots reads
the cache in place, a scattered one gathers a copy every layer of every step. Slots drift out of
order as requests finish and new ones fill the holes, so before each step the engine moves the few
out of place: a move copies once what the gather would copy each step. Slots never change a token.
"""
from __future__ import annotations

from collections import Counter


def arrange(slots: list[int], keys: list[int]) -> list[int]:
    """New slots for requests now in `slots` (distinct) with bucket `keys`: slots 0..n-1, the
    largest key first, one run of slots per key. A request already inside its key's run keeps its
    slot; the others fill the rest of their run in the order of their current slots."""
    counts = Counter(keys)
    runs, start = {}, 0
    for key in sorted(counts, reverse=True):
        runs[key] = (start, start + counts[key])
        start += counts[key]
    new = [s if runs[k][0] <= s < runs[k][1] else -1 for s, k in zip(slots, keys)]
    taken = set(s for s in new if s >= 0)
    holes = {k: iter(s for s in range(*runs[k]) if s not in taken) for k in runs}
    for i in sorted((i for i, s in enumerate(new) if s < 0), key=lambda i: slots[i]):
        new[i] = next(holes[keys[i]])
    return new
