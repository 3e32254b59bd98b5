"""Run guards: decide, from a step's numbers, whether to go on, skip, roll back or stop.

The guard holds no models; the loop asks it and carries out what it says. Its record (rollbacks
used, non-finite steps in a row, which checkpoints are known to be good, the learning rate after
a rollback) is part of every checkpoint, so a resumed run guards exactly as the original would.

A checkpoint saved after step t holds the weights that step t + 1 samples with, so it is
certified good (or bad) by the KL measured at step t + 1, not by the KL of step t; with the KL
guards off (rollback_kl and early_stop_kl null, or no reference), by the gradients of step t + 1
(no optimiser step skipped). A checkpoint of a step that skipped a gradient spike is never good.

After an update the health detectors (``health``) look at each optimiser step's gradient norm
and at the actor's entropy trend: a gradient spike skips its optimiser step, too many skips in a
window roll back like a KL excess, and an entropy collapse or surge warns, stops or rolls back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Optional

from klppo.safety.health import EntropyShift, EntropyTrend, GradSpikeDetector, SkippedStep
from klppo.safety.reward_hacking import DivergenceDetector, Trend

GRAD_MODELS = ("actor", "critic")


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
    # Run health (None switches a detector off; the defaults here are off, the config's are on).
    window: int = 20  # applied optimiser steps of gradient history; PPO steps of skips and entropy
    grad_spike: Optional[float] = None  # skip an optimiser step whose norm is more than this times its reference level
    max_grad_skips: int = 3  # PPO steps with a skipped spike within the window before a rollback
    entropy_collapse: Optional[float] = None  # relative entropy drop over the window that is an event
    entropy_surge: Optional[float] = None  # relative entropy rise over the window that is an event
    entropy_action: str = "warn"  # warn | stop | rollback
    initial_weights: bool = True  # a rollback can restore the initial weights (a reference or LoRA)
    divergence_validations: int = 3  # validations over which training and gold reward are compared
    divergence_action: str = "warn"  # warn | stop, when they diverge (reward_hacking.py)
    divergence_margin: float = 0.1  # a reward change smaller than this many of its spreads is flat


class Action(Enum):
    CONTINUE = "continue"  # update as usual
    SKIP = "skip"  # no optimiser step, no checkpoint this step
    ROLLBACK = "rollback"  # restore the last good weights, lower the learning rate, skip this update
    STOP = "stop"  # end the run; the last good checkpoint stays the newest


@dataclass
class GuardEvent:
    step: int
    # rollback | early_stop | skip_nonfinite | stop_nonfinite | warn_entropy | warn_clipfrac |
    # skip_grad_spike | rollback_grad_spike | stop_grad_spike | entropy_collapse | entropy_surge |
    # reward_divergence
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
        on = settings.grad_spike is not None
        self.grads = {m: GradSpikeDetector(settings.window, settings.grad_spike) for m in GRAD_MODELS if on}
        self.entropy = EntropyTrend(settings.window, settings.entropy_collapse, settings.entropy_surge)
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
        limit = self._kl_limit()
        if limit is not None:  # without a KL guard the gradients certify (``check_update``)
            if self.pending_checkpoint is not None and kl <= limit:
                self.good_checkpoints.append(self.pending_checkpoint)
            self.pending_checkpoint = None
        if self.s.rollback_kl is not None and kl > self.s.rollback_kl and self.rollbacks < self.s.max_rollbacks:
            self._spend_rollback()
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

    def grad_limit(self, model: str) -> float:
        """The largest gradient norm ``model``'s optimiser steps may apply in the coming update."""
        detector = self.grads.get(model)
        return detector.limit() if detector is not None else math.inf

    def check_update(self, step: int, grads: dict[str, tuple[list[float], list[bool]]], entropy: Optional[float],
                     existing: Optional[set[int]] = None) -> tuple[Action, dict[str, float]]:
        """After an update: each model's optimiser-step norms and whether each was applied, and the
        actor's entropy (None during the critic's warm-up). Returns the action and the step's
        ``<model>/grad_norm_skipped`` and ``_median`` (the reference level the steps were judged by)."""
        metrics, skipped = {}, 0
        for model, (norms, applied) in grads.items():
            metrics[f"{model}/grad_norm_skipped"] = float(applied.count(False))
            skipped += applied.count(False)
            if model in self.grads:
                metrics.update(self._record_grads(step, model, norms, applied))
        if self.pending_checkpoint is not None and self._kl_limit() is None:
            if skipped == 0:
                self.good_checkpoints.append(self.pending_checkpoint)
            self.pending_checkpoint = None
        action = Action.CONTINUE
        shift = self.entropy.observe(entropy) if entropy is not None else None
        if shift is not None:
            action = self._entropy_shift(step, shift, existing)
        if action is Action.CONTINUE:
            action = self._too_many_skips(step, existing)
        return action, metrics

    def _record_grads(self, step: int, model: str, norms: list[float], applied: list[bool]) -> dict[str, float]:
        detector, metrics = self.grads[model], {}
        level = detector.level()
        if level is not None:
            metrics[f"{model}/grad_norm_median"] = level
        seen = len(detector.norms)
        for skip in detector.record(step, norms, applied):
            self._skip_event(step, model, skip, seen)
        return metrics

    def _skip_event(self, step: int, model: str, skip: SkippedStep, seen: int) -> None:
        self._event(step, "skip_grad_spike", f"{model} gradient norm {skip.grad_norm:.4g} is {skip.ratio:.3g}x its "
                    f"reference level {skip.median:.4g} (the median of its last {seen} optimiser steps' norms, or of "
                    f"the run's first {self.s.window} where higher; log ratio {skip.log_ratio:.3g} > ln grad_spike "
                    f"{self.s.grad_spike}): optimiser step skipped", model=model, grad_norm=skip.grad_norm,
                    median=skip.median, ratio=skip.ratio, log_ratio=skip.log_ratio)

    def _too_many_skips(self, step: int, existing: Optional[set[int]]) -> Action:
        """More than max_grad_skips PPO steps of one model with a skipped spike within the window: roll
        back (or stop). Steps, not optimiser steps: one bad batch spikes every optimiser step of its
        update, and skipping them all is the guard working; spikes step after step are a run going wrong."""
        counts = {m: len(set(d.skipped_at)) for m, d in self.grads.items()}
        model = max(counts, key=counts.get, default=None)
        if model is None or counts[model] <= self.s.max_grad_skips:
            return Action.CONTINUE
        why = (f"{model} optimiser steps skipped for gradient spikes in {counts[model]} of the last {self.s.window} "
               f"steps (max_grad_skips={self.s.max_grad_skips})")
        values = {"model": model, "skips": counts[model], "window": self.s.window}
        action, target, where = self._roll_back_or_stop(existing)
        if action is Action.STOP:
            self._event(step, "stop_grad_spike", f"{why}, and {where}: run stopped", **values)
        else:
            self._event(step, "rollback_grad_spike", f"{why}: rolled back to {where}, actor lr now "
                        f"{self.s.rollback_lr} (rollback {self.rollbacks}/{self.s.max_rollbacks})",
                        **values, to_step=target if target is not None else 0)
        return action

    def _entropy_shift(self, step: int, shift: EntropyShift, existing: Optional[set[int]]) -> Action:
        """An entropy collapse or surge: an event, and entropy_action (a rollback when one is left)."""
        what = "fell" if shift.kind == "entropy_collapse" else "rose"
        threshold = self.s.entropy_collapse if shift.kind == "entropy_collapse" else self.s.entropy_surge
        why = (f"actor entropy {what} by {percent(abs(shift.change))} (more than {percent(threshold)}) to {shift.entropy:.4g} "
               f"{entropy_span(shift, self.s.window)}")
        action, target, where = Action.CONTINUE, None, "warning only (entropy_action=warn)"
        if self.s.entropy_action == "stop":
            action, where = Action.STOP, "run stopped (entropy_action=stop)"
        elif self.s.entropy_action == "rollback":
            action, target, where = self._roll_back_or_stop(existing)
            where = f"rolled back to {where}" if action is Action.ROLLBACK else f"{where}: run stopped"
        values = {"entropy": shift.entropy, "reference": shift.reference, "change": shift.change,
                  "window": shift.steps, "horizon": shift.horizon,
                  "action": action.value if action is not Action.CONTINUE else "warn"}
        if action is Action.ROLLBACK:
            values["to_step"] = target if target is not None else 0
        self._event(step, shift.kind, f"{why}: {where}", **values)
        return action

    def _roll_back_or_stop(self, existing: Optional[set[int]]) -> tuple[Action, Optional[int], str]:
        """Spend a rollback: (ROLLBACK, target step or None for the initial weights, where to), or
        (STOP, None, why none is possible)."""
        if self.rollbacks >= self.s.max_rollbacks:
            return Action.STOP, None, f"no rollback is left ({self.rollbacks}/{self.s.max_rollbacks} used)"
        target = self.rollback_target(existing)
        if target is None and not self.s.initial_weights:
            return Action.STOP, None, "no checkpoint is certified good and the initial weights are not kept"
        self._spend_rollback()
        return Action.ROLLBACK, target, f"checkpoint of step {target}" if target is not None else "the initial weights"

    def _spend_rollback(self) -> None:
        """One rollback used; the detectors' skips and entropy trend belong to the weights left behind."""
        self.rollbacks += 1
        self.lr_override = self.s.rollback_lr
        for detector in self.grads.values():
            detector.forget_skips()
        self.entropy.restart()

    def _kl_limit(self) -> Optional[float]:
        return self.s.rollback_kl if self.s.rollback_kl is not None else self.s.early_stop_kl

    def checkpoint_saved(self, step: int) -> None:
        """Called as step ``step``'s checkpoint is written (before, so the checkpoint holds it too).
        A checkpoint of a step that skipped a gradient spike is never a rollback target."""
        spiked = any(step in detector.skipped_at for detector in self.grads.values())
        self.pending_checkpoint = None if spiked else step

    def awaits_kl(self) -> bool:
        """Whether a checkpoint waits for the next KL measurement to certify it (a KL guard is on):
        an offline run whose probe skips steps measures on the step after each save (``probe_every``)."""
        return self.pending_checkpoint is not None and self._kl_limit() is not None

    def rollback_target(self, existing: Optional[set[int]] = None) -> Optional[int]:
        """The newest checkpoint certified good (and still on disk, if ``existing`` is given)."""
        good = [s for s in self.good_checkpoints if existing is None or s in existing]
        return good[-1] if good else None

    def observe_response_length(self, mean_length: float) -> float:
        """This step's mean response length; its least-squares slope per step over the last ``window``
        steps (``response_length/mean_trend``: a steadily growing length is a common sign of a
        reward that pays for length)."""
        return self.length_trend.observe(mean_length)

    def check_validation(self, step: int, train: tuple[float, float], gold: tuple[float, float]) -> Action:
        """One validation's (mean, spread) of the training and the gold reward on the same held-out
        responses (spread: their standard deviation over the responses); a new divergence
        (``reward_hacking.py``) is a ``reward_divergence`` event, and stops the run with
        ``divergence_action: stop``."""
        found = self.divergence.observe(train[0], gold[0], train[1], gold[1])
        if found is None:
            return Action.CONTINUE
        action = self.s.divergence_action
        self._event(step, "reward_divergence", f"training reward {found.train_change:+.4g} "
                    f"({found.train_shift:+.3g} of its spread {found.train_spread:.3g}) but gold reward "
                    f"{found.gold_change:+.4g} ({found.gold_shift:+.3g} of its spread {found.gold_spread:.3g}) over "
                    f"the last {found.validations} validations (divergence_margin {self.s.divergence_margin} "
                    "spreads): the policy may be gaming its reward" + ("; run stopped" if action == "stop" else ""),
                    train_change=found.train_change, gold_change=found.gold_change,
                    train_spread=found.train_spread, gold_spread=found.gold_spread,
                    train_shift=found.train_shift, gold_shift=found.gold_shift,
                    validations=found.validations, action=action)
        return Action.STOP if action == "stop" else Action.CONTINUE

    def state_dict(self) -> dict:
        own = ("s", "events", "grads", "entropy", "divergence", "length_trend")
        state = {k: v for k, v in vars(self).items() if k not in own}
        state["events"] = [asdict(e) for e in self.events]
        state["health"] = {"grads": {m: d.state_dict() for m, d in self.grads.items()},
                           "entropy": self.entropy.state_dict(), "divergence": self.divergence.state_dict(),
                           "length_trend": self.length_trend.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in ("rollbacks", "nonfinite_in_a_row", "good_checkpoints", "pending_checkpoint", "lr_override"):
            setattr(self, key, state[key])
        self.events = [GuardEvent(**e) for e in state.get("events", [])]
        health = state.get("health")  # absent from checkpoints saved before the detectors: they start afresh
        if health is not None:
            for model, detector in self.grads.items():
                if model in health["grads"]:
                    detector.load_state_dict(health["grads"][model])
            self.entropy.load_state_dict(health["entropy"])
            if "divergence" in health:
                self.divergence.load_state_dict(health["divergence"])
                self.length_trend.load_state_dict(health["length_trend"])


def entropy_span(shift: EntropyShift, window: int) -> str:
    """What an entropy shift was measured over, as the steps seen: "over the last 7 steps (earlier
    2.1)" while a window of 20 fills, "since the run's first 20 steps (their median 2.1; 140 steps)"."""
    if shift.horizon == "run":
        return f"since the run's first {window} steps (their median {shift.reference:.4g}; {shift.steps} steps)"
    return f"over the last {shift.steps} steps (earlier {shift.reference:.4g})"


def percent(fraction: float) -> str:
    """0.5 -> "50%", 2e-6 -> "0.0002%": three significant digits, however small the fraction."""
    return f"{fraction * 100:.3g}%"


def most_severe(*actions: Action) -> Action:
    """The action that wins when several checks of one step disagree."""
    order = (Action.CONTINUE, Action.SKIP, Action.ROLLBACK, Action.STOP)
    return max(actions, key=order.index)
