"""The history store's in-memory index: for each (prompt key, sample index), the steps whose
files hold a record of it; for each step's file, how many of its records are still the newest of
their key (a file at zero holds nothing a lookup would pick first, so `put` reports it dead).
Every operation costs O(records it names): a lookup never walks the files.
"""
from __future__ import annotations

import bisect
from typing import Mapping, Optional

Key = tuple[str, int]  # (prompt_key(prompt ids), sample index)


class HistoryIndex:
    def __init__(self):
        self._steps_of: dict[Key, list[int]] = {}
        self._rows: dict[int, dict[Key, int]] = {}  # step -> key -> row in that step's file
        self._live: dict[int, int] = {}

    def put(self, step: int, rows: Mapping[Key, int]) -> set[int]:
        """Make `rows` step's entries (replacing any it had). Returns the steps whose live count
        is 0 now: every record of theirs has a newer one (this step too, if it is older than all
        its keys' records)."""
        self.drop(step)
        self._rows[step] = dict(rows)
        self._live[step] = 0
        dead = set()
        for key in self._rows[step]:
            steps = self._steps_of.setdefault(key, [])
            before = steps[-1] if steps else None
            bisect.insort(steps, step)
            if steps[-1] != before:  # this step now holds the key's newest record
                self._live[step] += 1
                if before is not None:
                    self._live[before] -= 1
                    if self._live[before] == 0:
                        dead.add(before)
        if self._rows[step] and self._live[step] == 0:
            dead.add(step)
        return dead

    def drop(self, step: int) -> None:
        """Forget step's entries; keys whose newest record it held fall back to their next one."""
        for key in self._rows.pop(step, {}):
            steps = self._steps_of[key]
            newest = steps[-1]
            steps.remove(step)
            if not steps:
                del self._steps_of[key]
            elif newest == step:
                self._live[steps[-1]] += 1
        self._live.pop(step, None)

    def candidates(self, key: Key) -> list[int]:
        """The steps whose files hold `key`, ascending (the last holds its newest record)."""
        return self._steps_of.get(key, [])

    def row(self, step: int, key: Key) -> Optional[int]:
        return self._rows.get(step, {}).get(key)
