"""Run guards: decide, from a step's numbers, whether to go on, skip, roll back or stop.

The guard holds no models; the loop asks it and carries out what it says. Its record (rollbacks
used, non-finite steps in a row, which checkpoints are known to be good, the learning rate after
a rollback) is part of every checkpoint, so a resumed run guards exactly as the original would.

A checkpoint saved after step t holds the weights that step t + 1 samples with, so it is
certified good (or bad) by the KL measured at step t + 1, not by the KL of step t.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Optional

from klppo.trainer.reward_hacking import DivergenceDetector, Trend


@dataclass(frozen=True)
class GuardSettings:
    """The guard's thresholds (``trainer.guard.*``; None switches a check off)."""

    early_stop_kl: Optional[float]  # stop when the KL exceeds it and no rollback is left
    rollback_kl: Optional[float]  # roll back when the KL exceeds it
    rollback_lr: float  # the actor's learning rate from the first rollback on
    max_rollbacks: int
    max_nonfinite_steps: int  # non-finite steps in a row before the run stops
    entropy_floor: Optional[float]  # warn below this entropy
    clipfrac_max: Optional[float]  # warn above this clipped fraction
    window: int = 20  # steps in the windows of the per-step trends (response_length/mean_trend)
    divergence_validations: int = 3  # validations over which training and gold reward are compared
    divergence_action: str = "warn"  # warn | stop, when they diverge (reward_hacking.py)
    divergence_margin: float = 0.05  # a reward change smaller than this is flat


class Action(Enum):
    CONTINUE = "continue"  # update as usual
    SKIP = "skip"  # no optimiser step, no checkpoint this step
    ROLLBACK = "rollback"  # restore the last good weights, lower the learning rate, skip this update
    STOP = "stop"  # end the run; the last good checkpoint stays the newest


@dataclass
class GuardEvent:
    step: int
    # rollback | early_stop | skip_nonfinite | stop_nonfinite | warn_entropy | warn_clipfrac | reward_divergence
    kind: str
    message: str
    values: dict = field(default_factory=dict)

    def to_record(self) -> dict:
        return {"step": self.step, "kind": self.kind, "message": self.message, **self.values}


class RunGuard:
    """Checks KL before an update, finiteness around it, and entropy / clipping after it."""

    def __init__(self, settings: GuardSettings) -> None:
        self.s = settings
        self.rollbacks = 0
        self.nonfinite_in_a_row = 0
        self.good_checkpoints: list[int] = []
        self.pending_checkpoint: Optional[int] = None
        self.lr_override: Optional[float] = None
        self.events: list[GuardEvent] = []  # new since the loop last drained them
        self.divergence = DivergenceDetector(settings.divergence_validations, settings.divergence_margin)
        self.length_trend = Trend(settings.window)

    def _event(self, step: int, kind: str, message: str, **values) -> None:
        self.events.append(GuardEvent(step, kind, message, values))

    def drain_events(self) -> list[GuardEvent]:
        events, self.events = self.events, []
        return events

    def check_kl(self, step: int, kl: float, existing: Optional[set[int]] = None) -> Action:
        """The mean per-token KL of the policy that sampled this step's batch to the reference.

        ``existing``: the checkpoint steps still on disk (rollback targets must exist).
        """
        limit = self.s.rollback_kl if self.s.rollback_kl is not None else self.s.early_stop_kl
        if self.pending_checkpoint is not None and (limit is None or kl <= limit):
            self.good_checkpoints.append(self.pending_checkpoint)
        self.pending_checkpoint = None
        if self.s.rollback_kl is not None and kl > self.s.rollback_kl and self.rollbacks < self.s.max_rollbacks:
            self.rollbacks += 1
            self.lr_override = self.s.rollback_lr
            target = self.rollback_target(existing)
            where = f"checkpoint of step {target}" if target is not None else "the initial weights"
            self._event(step, "rollback", f"KL {kl:.4g} > rollback_kl {self.s.rollback_kl}: rolled back to {where}, "
                        f"actor lr now {self.s.rollback_lr} (rollback {self.rollbacks}/{self.s.max_rollbacks})",
                        kl=kl, to_step=target if target is not None else 0)
            return Action.ROLLBACK
        if self.s.early_stop_kl is not None and kl > self.s.early_stop_kl:
            self._event(step, "early_stop", f"KL {kl:.4g} > early_stop_kl {self.s.early_stop_kl} with no rollback "
                        f"left ({self.rollbacks}/{self.s.max_rollbacks} used): run stopped", kl=kl)
            return Action.STOP
        return Action.CONTINUE

    def check_finite(self, step: int, values: dict[str, float]) -> Action:
        """Rewards, losses and gradient norms of the step; any NaN/inf skips (or stops)."""
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if not bad:
            self.nonfinite_in_a_row = 0
            return Action.CONTINUE
        self.nonfinite_in_a_row += 1
        names = ", ".join(sorted(bad))
        if self.nonfinite_in_a_row >= self.s.max_nonfinite_steps:
            self._event(step, "stop_nonfinite", f"non-finite {names} for {self.nonfinite_in_a_row} steps in a row "
                        f"(max_nonfinite_steps={self.s.max_nonfinite_steps}): run stopped", **bad)
            return Action.STOP
        self._event(step, "skip_nonfinite", f"non-finite {names}: update skipped, weights unchanged "
                    f"({self.nonfinite_in_a_row} in a row)", **bad)
        return Action.SKIP

    def check_health(self, step: int, entropy: Optional[float], clipfrac: Optional[float]) -> None:
        """Warnings only: entropy collapse and too much clipping."""
        if self.s.entropy_floor is not None and entropy is not None and entropy < self.s.entropy_floor:
            self._event(step, "warn_entropy", f"actor entropy {entropy:.4g} < entropy_floor {self.s.entropy_floor}",
                        entropy=entropy)
        if self.s.clipfrac_max is not None and clipfrac is not None and clipfrac > self.s.clipfrac_max:
            self._event(step, "warn_clipfrac", f"clipped fraction {clipfrac:.4g} > clipfrac_max {self.s.clipfrac_max}",
                        clipfrac=clipfrac)

    def checkpoint_saved(self, step: int) -> None:
        self.pending_checkpoint = step

    def rollback_target(self, existing: Optional[set[int]] = None) -> Optional[int]:
        """The newest checkpoint certified good (and still on disk, if ``existing`` is given)."""
        good = [s for s in self.good_checkpoints if existing is None or s in existing]
        return good[-1] if good else None

    def observe_response_length(self, mean_length: float) -> float:
        """This step's mean response length; its least-squares slope per step over the last ``window``
        steps (``response_length/mean_trend``: a steadily growing length is a common sign of a
        reward that pays for length)."""
        return self.length_trend.observe(mean_length)

    def check_validation(self, step: int, train_reward: float, gold_reward: float) -> Action:
        """One validation's mean training and gold rewards on the same held-out responses; a new
        divergence (``reward_hacking.py``) is a ``reward_divergence`` event, and stops the run with
        ``divergence_action: stop``."""
        found = self.divergence.observe(train_reward, gold_reward)
        if found is None:
            return Action.CONTINUE
        action = self.s.divergence_action
        self._event(step, "reward_divergence", f"training reward {found.train_change:+.4g} but gold reward "
                    f"{found.gold_change:+.4g} over the last {found.validations} validations (divergence_margin "
                    f"{self.s.divergence_margin}): the policy may be gaming its reward"
                    + ("; run stopped" if action == "stop" else ""),
                    train_change=found.train_change, gold_change=found.gold_change, validations=found.validations,
                    action=action)
        return Action.STOP if action == "stop" else Action.CONTINUE

    def state_dict(self) -> dict:
        own = ("s", "events", "divergence", "length_trend")
        state = {k: v for k, v in vars(self).items() if k not in own}
        state["events"] = [asdict(e) for e in self.events]
        state["divergence"] = self.divergence.state_dict()
        state["length_trend"] = self.length_trend.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in ("rollbacks", "nonfinite_in_a_row", "good_checkpoints", "pending_checkpoint", "lr_override"):
            setattr(self, key, state[key])
        self.events = [GuardEvent(**e) for e in state.get("events", [])]
        if "divergence" in state:  # checkpoints written before the detectors start them empty
            self.divergence.load_state_dict(state["divergence"])
            self.length_trend.load_state_dict(state["length_trend"])
