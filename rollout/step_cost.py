"""What an engine step costs, as measured: seconds = fixed + per_token x tokens fed.

A draft token costs its share of the step whether or not it is accepted; what a share is depends
on the machine, the model, the dtype and the batch. On a CPU a forward is compute-bound and every
fed token costs about the same; on a GPU a small step costs its launches and host work whatever
it carries. So the engine times its own steps (plan, forward and verify: the host work that
drafts cause counts too) and this fits the line through them by exponentially weighted least
squares, recent steps weighing most. A short profile at the engine's first speculative run (two
forwards of different sizes) gives a prior slope that the fit shrinks towards, with the weight of
a couple of steps spread around the current size: it decides while the steps barely vary in size
and fades as soon as they do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DECAY = 0.97  # per step: the fit follows the last few dozen steps
PRIOR_STEPS = 2.0  # the profile's slope weighs as much as this many steps ...
PRIOR_SPREAD = 0.25  # ... spread this fraction of the current step size around it


@dataclass
class StepCost:
    sums: list = field(default_factory=lambda: [0.0] * 5)  # decayed w, wx, wy, wxx, wxy over steps
    anchor: list = field(default_factory=lambda: [0.0] * 5)  # the same sums over the profile's points
    # The fit of the sums as they stand: a step reads it several times and changes it once.
    _fitted: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def profiled(self) -> bool:
        return self.anchor[0] > 0

    def add_profile(self, tokens: int, seconds: float) -> None:
        _accumulate(self.anchor, 1.0, tokens, seconds)
        self._fitted = None

    def observe(self, tokens: int, seconds: float) -> None:
        self.fade(DECAY)
        _accumulate(self.sums, 1.0, tokens, seconds)

    def fade(self, factor: float) -> None:
        """Weigh every step so far by `factor` against those still to come."""
        self.sums = [s * factor for s in self.sums]
        self._fitted = None

    def state_dict(self) -> dict:
        return {"sums": list(self.sums), "anchor": list(self.anchor)}

    @classmethod
    def from_state_dict(cls, state: dict) -> StepCost:
        return cls(sums=[float(x) for x in state["sums"]], anchor=[float(x) for x in state["anchor"]])

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per fed token), both >= 0."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float]:
        prior_fixed, prior_slope = _line(self.anchor)
        w, x, y, xx, xy = self.sums
        if w <= 1e-9:
            return prior_fixed, prior_slope
        mx, my = x / w, y / w
        sxx, sxy = xx - w * mx * mx, xy - w * mx * my  # the steps' own spread and covariance
        k = PRIOR_STEPS * (PRIOR_SPREAD * mx) ** 2 if self.profiled else 0.0
        slope = (sxy + k * prior_slope) / (sxx + k) if sxx + k > 1e-12 else 0.0
        slope = min(max(slope, 0.0), my / mx if mx > 0 else 0.0)  # a step never costs less than nothing
        return max(my - slope * mx, 0.0), slope

    def per_token(self) -> float:
        return self.fit()[1]

    def predict(self, tokens: int) -> float:
        fixed, per_token = self.fit()
        return fixed + per_token * tokens


def _line(sums: list) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the summed points, clamped >= 0."""
    w, x, y, xx, xy = sums
    if w <= 0:
        return 0.0, 0.0
    mx, my = x / w, y / w
    var = xx / w - mx * mx
    slope = max((xy / w - mx * my) / var, 0.0) if var > 1e-12 * max(1.0, mx * mx) else 0.0
    return max(my - slope * mx, 0.0), slope


def _accumulate(sums: list, w: float, x: float, y: float) -> None:
    sums[0] += w
    sums[1] += w * x
    sums[2] += w * y
    sums[3] += w * x * x
    sums[4] += w * x * y
