"""Reward hacking, measured: the training reward against a held-out gold reward, and the trend of
response lengths.

Both detectors are plain, stateful objects whose state is a dict of numbers and lists, so the
guard that owns them (``guards.RunGuard``) puts it in every checkpoint and a resumed run sees
exactly the windows the original would have.

Divergence rule (``trainer.guard.divergence_*``): over the last K validations, with
``train_change`` and ``gold_change`` each reward's last value minus its first in that window and
m the margin, the rewards *diverge* when

    train_change > m  and  gold_change < m  and  train_change - gold_change > m

(the training reward rose by more than m while the gold reward did not, and the gap between
their changes is more than m). It is reported once per episode; the detector re-arms when the
two *agree* again, ``|train_change - gold_change| <= m``. The band between the two conditions
keeps a borderline window from reporting on and off. This is Goodhart's law made measurable as
in Gao et al. 2022, "Scaling laws for reward model overoptimization": the proxy keeps rising
while the gold reward stalls or falls.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Divergence:
    """A new divergence episode: the changes over the window and its length."""

    train_change: float
    gold_change: float
    validations: int


class DivergenceDetector:
    """Training vs gold reward over the last ``validations`` validations (the module's rule)."""

    def __init__(self, validations: int, margin: float) -> None:
        self.validations, self.margin = validations, margin
        self.history: deque[tuple[float, float]] = deque(maxlen=validations)  # (train, gold) per validation
        self.armed = True  # False from a reported divergence until the rewards agree again

    def observe(self, train: float, gold: float) -> Optional[Divergence]:
        """Record one validation's rewards; a ``Divergence`` when a new episode starts, else None."""
        self.history.append((train, gold))
        if len(self.history) < self.validations:
            return None
        train_change = self.history[-1][0] - self.history[0][0]
        gold_change = self.history[-1][1] - self.history[0][1]
        m = self.margin
        if abs(train_change - gold_change) <= m:
            self.armed = True
        diverging = train_change > m and gold_change < m and train_change - gold_change > m
        if diverging and self.armed:
            self.armed = False
            return Divergence(train_change, gold_change, self.validations)
        return None

    def state_dict(self) -> dict:
        return {"history": [list(pair) for pair in self.history], "armed": self.armed}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(tuple(pair) for pair in state["history"])
        self.armed = state["armed"]
