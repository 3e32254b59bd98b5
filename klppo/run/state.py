"""The state of a PPO run: what a checkpoint holds, and how it goes back into the parts.

A checkpoint has three parts (``klppo.checkpoint.state``): the models and optimisers, sharded
as the models are (every rank saves and loads its own shards); the run's shared state (step,
schedules, KL controller, data position, guard record), the same on every rank; and each
rank's RNG states.

``restore(..., weights_only=True)`` is what a rollback uses: models, optimisers and the KL
controller come back from the checkpoint, while the step, data position, RNG and guard record
move on, so the run's step counter and data stay monotonic.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from klppo.checkpoint.state import (
    checkpoint_steps, load_checkpoint, load_rank_state, load_sharded_state, rng_state, save_checkpoint, set_rng_state,
    step_dir,
)
from klppo.checkpoint.verify import find_resume_folder
from klppo.distributed import load_training_state, training_state
from klppo.run.adapters import restore_values
from klppo.run.build import PPOParts
from klppo.safety.guards import RunGuard


def _trained(parts: PPOParts) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
    pairs = [("actor", parts.actor, parts.actor_optimizer)]
    if parts.critic is not None:
        pairs.append(("critic", parts.critic, parts.critic_optimizer))
    return pairs


def sharded_state(parts: PPOParts) -> dict:
    """Models and optimisers as DCP saves and loads them: {"actor": ..., "actor_optimizer": ...}."""
    state = {}
    for name, model, optimizer in _trained(parts):
        state[name], state[f"{name}_optimizer"] = training_state(model, optimizer)
    return state


def save(parts: PPOParts, step: int, guard: RunGuard, keep: int | None) -> Path:
    """Checkpoint everything a resumed run needs to continue as if never stopped; every rank calls this."""
    shared = {
        "step": step,
        "actor_scheduler": parts.actor_scheduler.state_dict(),
        "kl_ctrl": parts.kl_ctrl.state_dict(),
        "data": parts.batches.state_dict(),
        "guard": guard.state_dict(),
    }
    if parts.critic is not None:
        shared["critic_scheduler"] = parts.critic_scheduler.state_dict()
    return save_checkpoint(parts.settings.run_dir, step, shared, sharded=sharded_state(parts),
                           rank_state={"rng": rng_state(parts.env.device)}, env=parts.env, keep=keep,
                           kind="ppo")


def resume_target(parts: PPOParts) -> Path | None:
    """The checkpoint this run continues from (``trainer.resume_mode``), checked whole before the run
    writes anything; None for a fresh start."""
    s, env = parts.settings, parts.env
    return find_resume_folder(s.run_dir, s.resume_mode, s.resume_from_path, kind="ppo", world_size=env.world_size,
                              sharded=lambda: sharded_state(parts), rank=env.rank)


def restore(parts: PPOParts, folder: Path, guard: RunGuard, *, weights_only: bool = False) -> int:
    """Load checkpoint ``folder`` into ``parts`` (and ``guard``); returns the step to continue after."""
    shared = load_checkpoint(folder)
    rank_state = None if weights_only else load_rank_state(folder, parts.env)  # refuses another world size
    sharded = sharded_state(parts)
    load_sharded_state(folder, sharded)
    for name, model, optimizer in _trained(parts):
        load_training_state(model, optimizer, sharded[name], sharded[f"{name}_optimizer"])
    parts.kl_ctrl.load_state_dict(shared["kl_ctrl"])
    if weights_only:
        return -1
    parts.actor_scheduler.load_state_dict(shared["actor_scheduler"])
    if parts.critic is not None:
        parts.critic_scheduler.load_state_dict(shared["critic_scheduler"])
    parts.batches.load_state_dict(shared["data"])
    set_rng_state(rank_state["rng"], parts.env.device)
    guard.load_state_dict(shared["guard"])
    return shared["step"]


def resume(parts: PPOParts, folder: Path, guard: RunGuard) -> int:
    """Continue from checkpoint ``folder`` as the run that wrote it would have: its state, then what
    the save left pending (``RunGuard.checkpoint_saved``: the next step's KL certifies this
    checkpoint, or the resumed guard would not know it good and a rollback would skip it) and the
    rollback's learning rate. Returns the step to continue after."""
    step = restore(parts, folder, guard)
    guard.checkpoint_saved(step)
    if guard.lr_override is not None:
        apply_lr_override(parts, guard.lr_override)
    return step


def restore_initial_actor(parts: PPOParts) -> None:
    """Roll the actor back to the weights the run started from and reset Adam: the reference's
    weights, or for a LoRA actor its adapters' starting values (the base weights never change)."""
    if parts.initial_adapters is not None:
        restore_values(parts.actor, parts.initial_adapters)
    else:
        parts.actor.load_state_dict(parts.ref.state_dict())
    parts.actor_optimizer.state = defaultdict(dict)


def apply_lr_override(parts: PPOParts, lr: float) -> None:
    """From now on the actor trains at a constant ``lr`` (the guard's rollback learning rate)."""
    for group in parts.actor_optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    parts.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(parts.actor_optimizer, lambda _: 1.0)


def roll_back(parts: PPOParts, guard: RunGuard) -> None:
    """The guard's rollback: the newest checkpoint it certified good (its weights only: the data
    position, RNG and step go on), or the run's starting weights when none is; then its lower
    learning rate."""
    run_dir = parts.settings.run_dir
    target = guard.rollback_target(set(checkpoint_steps(run_dir)))
    with parts.offloader.resident("actor", "critic", "ref"):
        if target is None:
            restore_initial_actor(parts)
        else:
            restore(parts, step_dir(run_dir, target), guard, weights_only=True)
    apply_lr_override(parts, guard.lr_override)


def release_training_state(parts: PPOParts) -> None:
    """After the last checkpoint: drop what the export does not need (optimiser states, the
    reference, critic and reward models), so rank 0 has room for the gathered actor once a
    collection has freed them."""
    for optimizer in (parts.actor_optimizer, parts.critic_optimizer):
        if optimizer is not None:
            optimizer.state.clear()
    parts.ref, parts.critic, parts.reward_models, parts.gold_reward_model = None, None, [], None
