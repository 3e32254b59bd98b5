"""Run-health keys of the PPO tree: ``trainer.guard`` (KL early stop and rollback, non-finite
steps, gradient spikes, entropy and clip-fraction warnings, reward divergence) and
``trainer.gold_reward`` (the held-out reward the divergence detector compares with). The
detectors themselves are in ``klppo/safety``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass
class GuardConfig:
    # Stop the run when a step's mean per-token KL to the reference exceeds this and no rollback
    # is left (the last good checkpoint stays the newest); null disables.
    early_stop_kl: Optional[float] = 0.2
    # Roll back to the last good checkpoint (or the initial weights) when a step's mean
    # per-token KL to the reference exceeds this; null disables.
    rollback_kl: Optional[float] = 0.15
    # Actor learning rate from the first rollback on.
    rollback_lr: float = 1e-6
    # Rollbacks allowed; one more KL excess then stops the run.
    max_rollbacks: int = 3
    # Consecutive steps with a non-finite reward, loss or gradient norm before the run stops.
    max_nonfinite_steps: int = 3
    # Warn when the actor's mean token entropy falls below this; null disables.
    entropy_floor: Optional[float] = 0.01
    # Warn when the fraction of clipped tokens exceeds this; null disables.
    clipfrac_max: Optional[float] = 0.3
    # Run health. History the detectors judge by: the last this many applied optimiser steps'
    # gradient norms, and the last this many PPO steps' skips, entropies and mean response
    # lengths (response_length/mean_trend); at least 6.
    window: int = 20
    # Skip an optimiser step whose gradient norm is more than this many times its reference level:
    # the median of the window's norms, or of the run's first `window` norms where higher (judged
    # as ln(norm / level) > ln(grad_spike)); null disables. Healthy learning runs reached 10.3x; a
    # step with 100x its advantages 106x or more (klppo/safety/health.py, tests/safety).
    grad_spike: Optional[float] = 30.0
    # PPO steps within the window in which one model's optimiser steps were skipped for a spike,
    # before a rollback (a stop when none is left); one bad batch skips all of its step's optimiser steps.
    max_grad_skips: int = 3
    # An event when the actor's entropy (mean of the last 3 steps) falls by more than this
    # fraction of the window's earlier level or of the run's first `window` steps' level (a slow
    # collapse); null disables.
    entropy_collapse: Optional[float] = 0.5
    # An event when it rises by more than this fraction of either level (1.0 = doubles); null disables.
    entropy_surge: Optional[float] = 1.0
    # What an entropy collapse or surge does: warn, stop the run, or roll back (as a KL excess).
    entropy_action: Literal["warn", "stop", "rollback"] = "warn"
    # With trainer.gold_reward: validations over which the training and the gold reward of the
    # same held-out responses are compared, each reward's change in units of its own spread (the
    # standard deviation of its scores over those responses); the training reward rising by more
    # than divergence_margin while the gold reward does not is a reward_divergence event.
    divergence_validations: int = 3
    # What a reward_divergence does: warn (an event) or stop (the event, then the run stops).
    divergence_action: Literal["warn", "stop"] = "warn"
    # A reward change over those validations smaller than this many of the reward's spreads counts
    # as flat (before: 0.05 reward units, which read a reward model in [-10, 10] and a 0/1 gold
    # reward on one scale).
    divergence_margin: float = 0.1


@dataclass
class GoldRewardConfig:
    # A held-out "gold" reward, scored at validation on the same responses as the training
    # reward and never trained on: a reward function file (path, name, as
    # custom_reward_function) or a reward model folder (model_path); all null = off.
    # Python file defining the gold reward function (verl's signature).
    path: Optional[str] = None
    # Name of the function in that file.
    name: str = "compute_score"
    # Keyword arguments passed on every call of that function (as custom_reward_function's).
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    # A reward-model folder (one-label sequence classification, as reward_model.model.path).
    model_path: Optional[str] = None
