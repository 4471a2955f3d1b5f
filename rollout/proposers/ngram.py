"""Prompt lookup: if the last n tokens occurred earlier in the prompt or response, guess that
what followed them then follows them now. Free to compute and strong on repetitive text."""
from __future__ import annotations

from array import array
from typing import Optional

from ..core.request import Request
from .base import Draft, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1)):
        self.sizes = tuple(sorted(set(ngram_sizes), reverse=True))

    @classmethod
    def from_config(cls, spec, model=None, engine_config=None) -> NgramProposer:
        return cls(spec.ngram_sizes)

    def propose(self, requests: list[Request], k: int) -> list[Optional[Draft]]:
        return [self._draft(req, k) for req in requests]

    def _draft(self, req: Request, k: int) -> Optional[Draft]:
        ids = req.all_ids
        # bytes.rfind scans in C; a hit counts only on a token boundary (offset % 4 == 0).
        hay = array("i", ids).tobytes()
        for n in self.sizes:
            if len(ids) <= n:
                continue
            needle = hay[-4 * n:]
            end = len(hay) - 4  # the match must end before the last token so something follows it
            while True:
                at = hay.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return Draft(ids[start:start + k], self, evidence=n)
                end = at + 4 * n - 1
        return None
