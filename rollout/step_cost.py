"""What an engine step costs, as measured:

    seconds = fixed + per_token x tokens fed + per_attended x tokens attended

A draft token costs its share of the step whether or not it is accepted; what a share is depends
on the machine, the model, the dtype, the batch and the context. On a CPU a forward is
compute-bound: every fed token costs its projections, and its attention over the context it
reads, which grows through a response ("attended": the context tokens the step's fed tokens
attend over, summed); a line in fed tokens alone takes the late steps' long contexts for a
fixed cost and prices drafts at a short context far too cheaply. On a GPU a small step costs its
launches and host work whatever it carries, and both slopes come out near zero. So the engine
times its own steps (plan, forward and verify: the host work that draft tokens cause counts too;
the proposers' own look-ups, which come per request, do not: rollout/controller.py
`observe_step`) and this fits the plane through them by exponentially weighted least squares, recent steps weighing
most. A short profile at the engine's first speculative run (forwards of different sizes and
contexts) gives prior slopes that the fit shrinks towards, with the weight of a couple of steps
spread around the current sizes: it decides while the steps barely vary and fades as soon as
they do. Callers that time something without a context (a draft head's positions) leave
`attended` at 0, and the fit is the line in tokens it always was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DECAY = 0.97  # per step: the fit follows the last few dozen steps
PRIOR_STEPS = 2.0  # the profile's slopes weigh as much as this many steps ...
PRIOR_SPREAD = 0.25  # ... spread this fraction of the current step sizes around them

# Decayed sums over (x1 = tokens, x2 = attended, y = seconds), weight w:
W, X1, X2, Y, X11, X12, X22, X1Y, X2Y = range(9)


@dataclass
class StepCost:
    sums: list = field(default_factory=lambda: [0.0] * 9)  # over the steps, decayed
    anchor: list = field(default_factory=lambda: [0.0] * 9)  # the same sums over the profile's points
    # The fit of the sums as they stand: a step reads it several times and changes it once.
    _fitted: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def profiled(self) -> bool:
        return self.anchor[W] > 0

    def add_profile(self, tokens: int, seconds: float, attended: float = 0.0) -> None:
        _accumulate(self.anchor, tokens, attended, seconds)
        self._fitted = None

    def observe(self, tokens: int, seconds: float, attended: float = 0.0) -> None:
        self.fade(DECAY)
        _accumulate(self.sums, tokens, attended, seconds)

    def fade(self, factor: float) -> None:
        """Weigh every step so far by `factor` against those still to come."""
        self.sums = [s * factor for s in self.sums]
        self._fitted = None

    def state_dict(self) -> dict:
        return {"sums": list(self.sums), "anchor": list(self.anchor)}

    @classmethod
    def from_state_dict(cls, state: dict) -> StepCost:
        return cls(sums=_nine(state["sums"]), anchor=_nine(state["anchor"]))

    def fit(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per fed token), both >= 0."""
        return self.plane()[:2]

    def plane(self) -> tuple[float, float, float]:
        """(fixed seconds per step, seconds per fed token, seconds per attended token), all >= 0."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> tuple[float, float, float]:
        prior = _plane(self.anchor, (0.0, 0.0), (0.0, 0.0))
        if self.sums[W] <= 1e-9:
            return prior
        spread = PRIOR_SPREAD if self.profiled else 0.0
        return _plane(self.sums, prior[1:], tuple(PRIOR_STEPS * (spread * self.sums[i] / self.sums[W]) ** 2
                                                  for i in (X1, X2)))

    def per_token(self) -> float:
        return self.plane()[1]

    def per_attended(self) -> float:
        return self.plane()[2]

    def predict(self, tokens: float, attended: float = 0.0) -> float:
        fixed, per_token, per_attended = self.plane()
        return fixed + per_token * tokens + per_attended * attended


def attended(cached: int, tokens: int) -> int:
    """The context `tokens` new tokens after `cached` ones attend over, summed: each reads
    itself and everything before it."""
    return tokens * cached + tokens * (tokens + 1) // 2


def _plane(sums: list, prior: tuple, weight: tuple) -> tuple[float, float, float]:
    """(intercept, slope in x1, slope in x2) of the weighted least-squares plane through the summed
    points, each slope shrunk towards its prior by `weight` (a ridge on the centred points), all
    clamped >= 0. A slope whose regressor neither varies nor has a weight takes its prior."""
    w = sums[W]
    if w <= 0:
        return 0.0, 0.0, 0.0
    m1, m2, my = sums[X1] / w, sums[X2] / w, sums[Y] / w
    s11 = sums[X11] - w * m1 * m1 + weight[0]
    s22 = sums[X22] - w * m2 * m2 + weight[1]
    s12 = sums[X12] - w * m1 * m2
    t1 = sums[X1Y] - w * m1 * my + weight[0] * prior[0]
    t2 = sums[X2Y] - w * m2 * my + weight[1] * prior[1]
    b1, b2 = _solve(s11, s12, s22, t1, t2, prior, scale=max(1.0, m1 * m1, m2 * m2))
    over = b1 * m1 + b2 * m2
    if over > my > 0:  # a step never costs less than nothing: the slopes shrink to a zero intercept
        b1, b2 = b1 * my / over, b2 * my / over
    return max(my - b1 * m1 - b2 * m2, 0.0), b1, b2


def _solve(s11, s12, s22, t1, t2, prior, scale) -> tuple[float, float]:
    """The slopes >= 0 of the 2 x 2 normal equations; a regressor without spread keeps its prior."""
    eps = 1e-12 * scale
    live1, live2 = s11 > eps, s22 > eps
    det = s11 * s22 - s12 * s12
    if live1 and live2 and det > 1e-9 * s11 * s22:
        b1, b2 = (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
        if b1 >= 0 and b2 >= 0:
            return b1, b2
        # One slope came out negative: it is 0, and the other is fitted alone.
        if b1 < 0:
            return 0.0, max(t2 / s22, 0.0)
        return max(t1 / s11, 0.0), 0.0
    b1 = max((t1 - s12 * prior[1]) / s11, 0.0) if live1 else prior[0]
    b2 = max((t2 - s12 * b1) / s22, 0.0) if live2 else prior[1]
    return b1, b2


def _accumulate(sums: list, x1: float, x2: float, y: float) -> None:
    for i, v in ((W, 1.0), (X1, x1), (X2, x2), (Y, y), (X11, x1 * x1), (X12, x1 * x2), (X22, x2 * x2),
                 (X1Y, x1 * y), (X2Y, x2 * y)):
        sums[i] += v


def _nine(sums) -> list:
    """The sums as stored; a checkpoint from before contexts were timed stored five (w, x, y,
    xx, xy) over tokens alone."""
    s = [float(x) for x in sums]
    if len(s) == 5:
        w, x, y, xx, xy = s
        return [w, x, 0.0, y, xx, 0.0, 0.0, xy, 0.0]
    return s
