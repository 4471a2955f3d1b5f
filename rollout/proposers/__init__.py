"""Draft sources. Each is a guesser: the engine verifies every draft token exactly."""
from __future__ import annotations

from .base import Proposer
from .ngram import NgramProposer


def make_proposers(spec) -> list:
    """The proposers a SpecConfig names, in its order (None -> no speculation)."""
    if spec is None:
        return []
    out = []
    for name in spec.proposers:
        if name == "ngram":
            out.append(NgramProposer(spec.ngram_sizes))
        elif name == "history":
            from .history import HistoryProposer
            out.append(HistoryProposer())
        elif name == "lookahead":
            from .lookahead import LookaheadProposer
            out.append(LookaheadProposer())
        elif name == "suffix":
            from .suffix import SuffixProposer
            out.append(SuffixProposer())
        else:
            raise ValueError(f"proposer {name!r} is not available yet")
    return out


__all__ = ["Proposer", "NgramProposer", "make_proposers"]
