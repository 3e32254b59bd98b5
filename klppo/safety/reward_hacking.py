"""Reward hacking, measured: the training reward against a held-out gold reward, and the trend of
response lengths.

Both detectors are plain, stateful objects whose state is a dict of numbers and lists, so the
guard that owns them (``guards.RunGuard``) puts it in every checkpoint and a resumed run sees
exactly the windows the original would have.

Divergence rule (``trainer.guard.divergence_*``): over the last K validations, each reward's
change is its last mean minus its first in that window, *divided by its spread*: the standard
deviation of its scores over the held-out responses, averaged over the window's validations. A
reward model in [-10, 10] and a 0/1 gold reward then move in the same unit, the effect size
(Cohen's d): in reward units, a reward model rising by 0.5 beside a 0/1 gold reward rising by
0.04 (both improved) read as a divergence at a margin of 0.05. With ``train`` and
``gold`` those normalised changes and m the margin (in spreads), the rewards *diverge* when

    train > m  and  gold < m  and  train - gold > m

(the training reward rose by more than m of its spreads while the gold reward did not, and the
gap between their changes is more than m). It is reported once per episode; the detector
re-arms when the two *agree* again, ``|train - gold| <= m``. The band between the two conditions
keeps a borderline window from reporting on and off. This is Goodhart's law made measurable as
in Gao et al. 2022, "Scaling laws for reward model overoptimization": the proxy keeps rising
while the gold reward stalls or falls.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence


def least_squares_slope(values: Sequence[float]) -> float:
    """The slope of the least-squares line through (0, v0), (1, v1), ...; 0.0 for fewer than 2 values.

    slope = sum((i - i_mean) * (v - v_mean)) / sum((i - i_mean)^2).
    """
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    num = sum((i - x_mean) * (v - y_mean) for i, v in enumerate(values))
    den = sum((i - x_mean) ** 2 for i in range(n))
    return num / den


class Trend:
    """The least-squares slope per step of a value over its last ``window`` observations."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> float:
        """Record this step's value; the slope over the window, this step included."""
        self.values.append(value)
        return least_squares_slope(list(self.values))

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values.clear()
        self.values.extend(state["values"])


def in_spreads(change: float, spread: float) -> float:
    """``change`` in units of ``spread``; a reward with no spread at all (every response scored
    alike) moved by nothing (0.0) or by infinitely many spreads (+-inf)."""
    if spread > 0:
        return change / spread
    return 0.0 if change == 0 else math.copysign(math.inf, change)


def diverging(train: float, gold: float, margin: float) -> bool:
    """The module's rule on two changes in spreads: the training reward rose past the margin, the
    gold reward did not, and the gap between them exceeds it."""
    return train > margin and gold < margin and train - gold > margin


@dataclass(frozen=True)
class Divergence:
    """A new divergence episode: the changes over the window (in reward units and in spreads), the
    spreads they were divided by, and the window's length."""

    train_change: float
    gold_change: float
    validations: int
    train_spread: float
    gold_spread: float

    @property
    def train_shift(self) -> float:
        return in_spreads(self.train_change, self.train_spread)

    @property
    def gold_shift(self) -> float:
        return in_spreads(self.gold_change, self.gold_spread)


class DivergenceDetector:
    """Training vs gold reward over the last ``validations`` validations (the module's rule)."""

    def __init__(self, validations: int, margin: float) -> None:
        self.validations, self.margin = validations, margin
        # (train mean, gold mean, train spread, gold spread) per validation
        self.history: deque[tuple[float, float, float, float]] = deque(maxlen=validations)
        self.armed = True  # False from a reported divergence until the rewards agree again

    def observe(self, train: float, gold: float, train_spread: float, gold_spread: float) -> Optional[Divergence]:
        """Record one validation's mean rewards and their spreads (the standard deviation of each
        over the held-out responses); a ``Divergence`` when a new episode starts, else None."""
        self.history.append((train, gold, train_spread, gold_spread))
        if len(self.history) < self.validations:
            return None
        found = Divergence(self.history[-1][0] - self.history[0][0], self.history[-1][1] - self.history[0][1],
                           self.validations, statistics.fmean(h[2] for h in self.history),
                           statistics.fmean(h[3] for h in self.history))
        t, g, m = found.train_shift, found.gold_shift, self.margin
        if abs(t - g) <= m:
            self.armed = True
        if diverging(t, g, m) and self.armed:
            self.armed = False
            return found
        return None

    def state_dict(self) -> dict:
        return {"history": [list(row) for row in self.history], "armed": self.armed}

    def load_state_dict(self, state: dict) -> None:
        """A record saved before the spreads (pairs of means) starts the window afresh."""
        self.history.clear()
        self.history.extend(tuple(row) for row in state["history"] if len(row) == 4)
        self.armed = state["armed"]
