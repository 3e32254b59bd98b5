"""Run-health detectors: a model's gradient norm against its own recent history, and the trend
of the actor's entropy (against its recent history and against the run's first steps).

They hold plain Python numbers only (their ``state_dict`` goes into every checkpoint through the
guard's record, so a resumed run detects exactly what the uninterrupted one would) and decide
nothing about the run: ``guards.RunGuard`` owns them and turns what they see into actions.

Gradient spikes are judged in log space, against a robust trend: a norm's log ratio to its
reference level, ``ln(norm / level)``, above ``ln(trainer.guard.grad_spike)`` is a spike. The
level is the median of the last ``window`` applied optimiser steps' norms (a running median,
Tukey's robust smoother: it follows a trend and ignores single outliers), or the median of the
run's first ``window`` applied norms where that is higher: a critic that has converged on a
constant reward has norms 1000x below its start, and a batch that teaches it something again is
no blow-up (a tiny learning run's critic returned to 470x its window median that way). Healthy
learning moves norms by ratios (3x over 20 steps while the model learns, 10x when the reward
first arrives), so a threshold on the ratio, not on the spread of the norms around their median,
stays quiet: replayed on the demos' and the test suite's learning runs
(``tests/safety/test_grad_norm_replay.py``), the largest log ratio was 2.33 (10.3x, a critic at
the step its policy first earned reward), while a step whose advantages are 100x too large lands
at 4.66 (106x) or more; the default 30 (ln 30 = 3.40) lies about midway, in log space. (The
log ratio divided by the log norms' MAD did not separate them: 5.5 scales on a healthy critic,
3.4 on a planted step of a run whose norms swing widely.) A skipped
step never enters the window, else a blow-up would become the new normal.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Optional

MIN_NORMS = 5  # applied norms in the window before any step is called a spike
RECENT_STEPS = 3  # the entropy trend compares the mean of this many newest steps with the window's earlier ones


def reference_level(recent: list[float], early: list[float], window: int) -> Optional[float]:
    """The level a gradient norm is judged against: the median of the ``recent`` applied norms, or
    the median of the run's ``early`` ones (its first ``window``) once they are complete and where
    that is higher; None while fewer than MIN_NORMS recent norms are known."""
    if len(recent) < MIN_NORMS:
        return None
    level = statistics.median(recent)
    if len(early) >= window:
        level = max(level, statistics.median(early))
    return level


def spike_log_ratio(norm: float, level: float) -> float:
    """ln(norm / level): how far above its reference level a norm lies (ln 30 = 3.40 is 30x)."""
    return math.log(norm / level)


@dataclass(frozen=True)
class SkippedStep:
    """An optimiser step whose gradient norm was too large (finite) to apply."""

    grad_norm: float
    median: float  # the reference level it was judged against (``reference_level``)
    log_ratio: float  # spike_log_ratio(grad_norm, median)

    @property
    def ratio(self) -> float:
        return self.grad_norm / self.median


class GradSpikeDetector:
    """One model's gradient norms: the largest norm a step may apply, and the steps it skipped.

    ``window``: applied optimiser steps whose norms set the reference level (the newest, and the
    run's first), and also the PPO steps over which skipped optimiser steps are counted.
    ``threshold``: ``trainer.guard.grad_spike``, the largest ratio of a norm to that level.
    """

    def __init__(self, window: int, threshold: float) -> None:
        self.window, self.threshold = window, threshold
        self.norms: list[float] = []  # the newest ``window`` applied, positive norms, oldest first
        self.early: list[float] = []  # the run's first ``window`` applied, positive norms
        self.skipped_at: list[int] = []  # the PPO step of each finite spike skipped in the last ``window`` steps

    def level(self) -> Optional[float]:
        """The reference level the next norms are judged against (``reference_level``), or None."""
        return reference_level(self.norms, self.early, self.window)

    def limit(self) -> float:
        """The largest norm an optimiser step may be applied with; inf while the window warms up.
        A norm above it has ``spike_log_ratio(norm, level) > ln(threshold)``."""
        level = self.level()
        return math.inf if level is None else level * self.threshold

    def record(self, step: int, norms: list[float], applied: list[bool]) -> list[SkippedStep]:
        """The optimiser steps of PPO step ``step``: their norms and whether each was applied (as
        the update decided, against ``limit()`` taken before it). Applied norms join the window;
        returns the finite norms that were skipped. A zero norm (nothing to learn from the batch)
        says nothing about the gradients' scale and stays out; non-finite norms belong to the
        non-finite guard (``RunGuard.check_finite``) and are neither kept nor counted here."""
        before = self.level()
        skipped = []
        for norm, ok in zip(norms, applied):
            if ok and norm > 0:
                self.norms.append(norm)
                if len(self.early) < self.window:
                    self.early.append(norm)
            elif not ok and math.isfinite(norm):
                assert before is not None, "a step was skipped before the window had a limit"
                skipped.append(SkippedStep(norm, before, spike_log_ratio(norm, before)))
        del self.norms[:-self.window]
        self.skipped_at = [s for s in self.skipped_at if s > step - self.window] + [step] * len(skipped)
        return skipped

    def forget_skips(self) -> None:
        """After a rollback the skips that caused it are dealt with; the norms stay the reference."""
        self.skipped_at = []

    def state_dict(self) -> dict:
        return {"norms": list(self.norms), "early": list(self.early), "skipped_at": list(self.skipped_at)}

    def load_state_dict(self, state: dict) -> None:
        """A record saved before the run's first norms were kept starts them from the resumed steps."""
        self.norms = [float(v) for v in state["norms"]][-self.window:]
        self.early = [float(v) for v in state.get("early", [])][:self.window]
        self.skipped_at = [int(s) for s in state["skipped_at"]]


@dataclass(frozen=True)
class EntropyShift:
    """A collapse or surge of the actor's entropy: the recent mean against an earlier level."""

    kind: str  # entropy_collapse | entropy_surge
    entropy: float  # the mean of the newest RECENT_STEPS steps
    reference: float  # the earlier level: the window's earlier steps' median, or the run's first steps'
    change: float  # (entropy - reference) / reference
    steps: int  # the PPO steps the comparison spans, this one included (as many as were seen, at most the window)
    horizon: str  # "window": the last ``steps`` steps; "run": since the run's first steps


def relative_change(values: list[float]) -> Optional[tuple[float, float, float]]:
    """(recent mean, earlier median, relative change) of a window, or None while it is too short
    (fewer than RECENT_STEPS earlier values) or the earlier level is not positive."""
    if len(values) < 2 * RECENT_STEPS:
        return None
    return change_from(statistics.median(values[:-RECENT_STEPS]), values[-RECENT_STEPS:])


def change_from(reference: float, recent: list[float]) -> Optional[tuple[float, float, float]]:
    """(mean of ``recent``, ``reference``, their relative change), or None for a level that is not positive."""
    if not reference > 0:
        return None
    entropy = statistics.fmean(recent)
    return entropy, reference, (entropy - reference) / reference


def extreme_change(candidates: list[EntropyShift], kind: str) -> Optional[EntropyShift]:
    """The candidate that moved furthest in ``kind``'s direction (the lowest change for a collapse,
    the highest for a surge), relabelled as ``kind``; None without candidates."""
    if not candidates:
        return None
    pick = min if kind == "entropy_collapse" else max
    return dataclasses.replace(pick(candidates, key=lambda c: c.change), kind=kind)


class EntropyTrend:
    """The actor's entropy against two earlier levels: the median of the earlier steps of the last
    ``window`` PPO steps (a fast change), and the median of the run's first ``window`` steps (a
    slow one: a collapse spread over 100 steps moves little within any 20-step window, but shows
    against where the run started). A drop by more than ``collapse`` (a fraction of the earlier
    level) against either, or a rise by more than ``surge``, is reported once per episode, and
    re-armed when the change against both comes back within half its threshold (so a trend that
    hovers at the threshold does not report every other step). None switches a direction off."""

    def __init__(self, window: int, collapse: Optional[float], surge: Optional[float]) -> None:
        self.window, self.collapse, self.surge = window, collapse, surge
        self.values: list[float] = []  # the newest ``window`` entropies since the start (or the last rollback)
        self.early: list[float] = []  # the run's first ``window`` entropies: the long-horizon reference
        self.seen = 0  # entropies observed since the run started
        self.active: Optional[str] = None  # the kind reported and not yet recovered from

    def changes(self) -> list[EntropyShift]:
        """The recent mean against each reference available yet (kind left blank)."""
        out = []
        window = relative_change(self.values)
        if window is not None:
            out.append(EntropyShift("", *window, len(self.values), "window"))
        if len(self.early) == self.window and len(self.values) >= RECENT_STEPS:
            run = change_from(statistics.median(self.early), self.values[-RECENT_STEPS:])
            if run is not None:
                out.append(EntropyShift("", *run, self.seen, "run"))
        return out

    def observe(self, entropy: float) -> Optional[EntropyShift]:
        """Add one PPO step's entropy (non-finite values are the non-finite guard's); a new episode or None."""
        if not math.isfinite(entropy):
            return None
        self.seen += 1
        self.values = (self.values + [entropy])[-self.window:]
        if len(self.early) < self.window:
            self.early.append(entropy)
        candidates = self.changes()
        fell = extreme_change(candidates, "entropy_collapse")
        rose = extreme_change(candidates, "entropy_surge")
        shift = None
        if fell is not None and self.collapse is not None and fell.change < -self.collapse:
            shift = fell
        elif rose is not None and self.surge is not None and rose.change > self.surge:
            shift = rose
        if self.active is not None and shift is None and self._recovered(fell, rose):
            self.active = None
        if shift is None or shift.kind == self.active:
            return None
        self.active = shift.kind
        return shift

    def _recovered(self, fell: Optional[EntropyShift], rose: Optional[EntropyShift]) -> bool:
        if self.active == "entropy_collapse":
            return self.collapse is None or fell is None or fell.change >= -self.collapse / 2
        return self.surge is None or rose is None or rose.change <= self.surge / 2

    def restart(self) -> None:
        """After a rollback the weights are earlier ones: comparing their entropy with the
        entropies before the rollback would report a surge (or collapse) that is not one. The
        run's first steps stay the long-horizon reference: the rollback does not move the start."""
        self.values, self.active = [], None

    def state_dict(self) -> dict:
        return {"values": list(self.values), "active": self.active, "early": list(self.early), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        """A record saved before the long-horizon reference had none: it starts from the resumed steps."""
        self.values = [float(v) for v in state["values"]][-self.window:]
        self.active = state["active"] if state["active"] in ("entropy_collapse", "entropy_surge") else None
        self.early = [float(v) for v in state.get("early", [])][:self.window]
        self.seen = int(state.get("seen", len(self.values)))
