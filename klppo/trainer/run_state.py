"""The state of a PPO run: what a checkpoint holds, and how it goes back into the parts.

``restore(..., weights_only=True)`` is what a rollback uses: models, optimisers and the KL
controller come back from the checkpoint, while the step, data position, RNG and guard record
move on, so the run's step counter and data stay monotonic.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from klppo.checkpoint.state import rng_state, set_rng_state
from klppo.trainer.build import PPOParts
from klppo.trainer.guards import RunGuard


def capture(parts: PPOParts, step: int, guard: RunGuard) -> dict:
    """Everything a resumed run needs to continue as if never stopped."""
    state = {
        "step": step,
        "actor": parts.actor.state_dict(),
        "actor_optimizer": parts.actor_optimizer.state_dict(),
        "actor_scheduler": parts.actor_scheduler.state_dict(),
        "kl_ctrl": parts.kl_ctrl.state_dict(),
        "data": parts.batches.state_dict(),
        "rng": rng_state(),
        "guard": guard.state_dict(),
    }
    if parts.critic is not None:
        state.update(critic=parts.critic.state_dict(), critic_optimizer=parts.critic_optimizer.state_dict(),
                     critic_scheduler=parts.critic_scheduler.state_dict())
    return state


def restore(parts: PPOParts, state: dict, guard: RunGuard, *, weights_only: bool = False) -> int:
    """Load ``state`` into ``parts`` (and ``guard``); returns the step to continue after."""
    parts.actor.load_state_dict(state["actor"])
    parts.actor_optimizer.load_state_dict(state["actor_optimizer"])
    if parts.critic is not None:
        parts.critic.load_state_dict(state["critic"])
        parts.critic_optimizer.load_state_dict(state["critic_optimizer"])
    parts.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if weights_only:
        return -1
    parts.actor_scheduler.load_state_dict(state["actor_scheduler"])
    if parts.critic is not None:
        parts.critic_scheduler.load_state_dict(state["critic_scheduler"])
    parts.batches.load_state_dict(state["data"])
    set_rng_state(state["rng"])
    guard.load_state_dict(state["guard"])
    return state["step"]


def restore_initial_actor(parts: PPOParts) -> None:
    """Roll the actor back to the weights the run started from (the reference's) and reset Adam."""
    parts.actor.load_state_dict(parts.ref.state_dict())
    parts.actor_optimizer.state = defaultdict(dict)


def apply_lr_override(parts: PPOParts, lr: float) -> None:
    """From now on the actor trains at a constant ``lr`` (the guard's rollback learning rate)."""
    for group in parts.actor_optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    parts.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(parts.actor_optimizer, lambda _: 1.0)
