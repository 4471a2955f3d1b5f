"""The step-cost table the draft budget (rollout/budget/budget.py) prices draft tokens with.

A forward feeding F tokens costs `table(F)`, plus `per_attended` per context token each row's
first token attends over and `per_attended_draft` per context token each further token (a draft)
of the row attends over: the further tokens read the keys and values the first one loads, so they
cost a fraction of it. Around the forward, each row of a step costs `per_row` of host work
(planning, verifying, emitting, asking the proposers): next to a large model's forward it is
nothing, next to a tiny one's it is most of the step. `table` is piecewise linear through a short
profile taken once per (device, CPU model, model shape, dtype, threads, proposers) and cached under
$SPECTAIL_CACHE (else ~/.cache/spectail)/step_cost, or given as SpecConfig.step_cost.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class StepCost:
    """seconds = table(F) + per_attended x (rows' contexts) + per_attended_draft x (drafts' contexts)
    + per_row x rows; `tokens` ascending, `seconds` non-decreasing; per_attended_draft None: per_attended's."""

    tokens: tuple
    seconds: tuple
    per_attended: float = 0.0
    per_attended_draft: Optional[float] = None
    per_row: float = 0.0

    @property
    def draft_attended(self) -> float:
        return self.per_attended if self.per_attended_draft is None else self.per_attended_draft

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        if not isinstance(d, dict) or "tokens" not in d or "seconds" not in d:
            raise ValueError(f"step_cost must be a dict with 'tokens' and 'seconds' lists, got {d!r}")
        tokens, seconds = [int(t) for t in d["tokens"]], [float(s) for s in d["seconds"]]
        if not tokens or len(tokens) != len(seconds) or tokens != sorted(set(tokens)) or tokens[0] < 1:
            raise ValueError(f"step_cost needs ascending distinct 'tokens' >= 1 and as many 'seconds', got {d!r}")
        draft = d.get("per_attended_draft")
        if (min(seconds) < 0 or not float(d.get("per_attended", 0.0)) >= 0 or not (draft is None or float(draft) >= 0)
                or not float(d.get("per_row", 0.0)) >= 0):
            raise ValueError(f"step_cost seconds, per_attended, per_attended_draft and per_row must be >= 0, got {d!r}")
        # a forward never costs less for feeding more; a timing errs only slow (a cold cache, a busy
        # core), so a point above a larger forward's is lowered to it rather than the later ones raised
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(tuple(tokens), tuple(seconds), float(d.get("per_attended", 0.0)),
                   None if draft is None else float(draft), float(d.get("per_row", 0.0)))

    def table(self, fed: float) -> float:
        """Linear between the measured points; beyond them, along the nearest segment (flat with one point)."""
        t, s = self.tokens, self.seconds
        if len(t) == 1:
            return s[0]
        i = min(max(bisect.bisect_right(t, fed) - 1, 0), len(t) - 2)
        return max(s[i] + (s[i + 1] - s[i]) * (fed - t[i]) / (t[i + 1] - t[i]), 0.0)

    def marginal(self, fed: int) -> float:
        """Seconds one more fed token adds to a forward that feeds `fed`."""
        return self.table(fed + 1) - self.table(fed)


def cache_path(key: dict) -> str:
    root = os.environ.get("SPECTAIL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spectail")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, "step_cost", f"{digest}.json")


def cached(key: dict, measure: Callable[[], dict]) -> dict:
    """The measurement stored under `key`, else `measure()` stored there (atomically)."""
    path = cache_path(key)
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored.get("key") == key:
            return stored["value"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    value = measure()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measured again next time, nothing worse
        warnings.warn(f"step cost not cached at {path}: {e}", stacklevel=2)
    return value


def machine() -> str:
    """The CPU model (what a CPU forward's speed depends on besides the model and threads)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine() or platform.processor()


def profile_grid(most: int) -> list[int]:
    """Fed-token counts the profile times: powers of two below `most`, and `most`."""
    return [1 << i for i in range(max(most - 1, 0).bit_length())] + [max(most, 1)]


def profile(time_forward: Callable[..., float], grid: Sequence[int], rows: int, context: int,
            depth: int, time_host: Optional[Callable[[], float]] = None) -> dict:
    """A StepCost dict from time_forward(fed, cached, rows=None): seconds of a forward feeding `fed`
    tokens over `rows` slots (None: one token a slot up to the batch size) after `cached` each.
    per_attended from `rows` rows of one token after `context` each; per_attended_draft from the
    same rows of `depth` tokens; per_row from time_host() (0 without it)."""
    seconds = [time_forward(f, 0) for f in grid]
    cost = StepCost.from_dict({"tokens": list(grid), "seconds": seconds})
    per_attended = per_draft = 0.0
    if context > 0:
        per_attended = max(time_forward(rows, context, rows) - cost.table(rows), 0.0) / (rows * context)
        if depth > 1:
            deep = time_forward(rows * depth, context, rows) - time_forward(rows * depth, 0, rows)
            per_draft = max(deep - per_attended * rows * context, 0.0) / (rows * (depth - 1) * context)
    return {"tokens": list(grid), "seconds": seconds, "per_attended": per_attended, "per_attended_draft": per_draft,
            "per_row": max(time_host(), 0.0) if time_host is not None else 0.0}
