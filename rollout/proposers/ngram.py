"""Prompt lookup: if the last n tokens occurred earlier in the prompt or response, guess that
what followed them then follows them now. Free to compute and strong on repetitive text."""
from __future__ import annotations

from array import array

from ..request import Request


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_sizes: tuple[int, ...] = (3, 2, 1)):
        self.sizes = tuple(sorted(set(ngram_sizes), reverse=True))
        self._evidence: dict[int, int] = {}  # id(req) -> n of the n-gram behind its last draft

    def propose(self, req: Request, k: int) -> list[int]:
        self._evidence[id(req)] = 0
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
                    self._evidence[id(req)] = n
                    return ids[start:start + k]
                end = at + 4 * n - 1
        return []

    def observe(self, req: Request, draft: list[int], num_accepted: int, emitted: list[int]) -> None:
        pass

    def evidence(self, req: Request) -> int:
        return self._evidence.get(id(req), 0)

    def finish(self, req: Request) -> None:
        self._evidence.pop(id(req), None)
