"""Check a resume target whole, before a run loads or writes anything.

A run resumes only from a checkpoint of its own kind ("ppo", "sft", "rm") that is complete and
unmodified: ``trainer_state.pt`` and every ``rank_R.pt`` load as plain data and have the keys
that kind of run saves; there is one rank file per rank of this run; ``weights/.metadata``
loads (without running code) and names every key the run will ask for, with the shapes it
expects; every shard file it lists exists and is as long as the metadata says. Each problem
is one ``UserError`` that names the file and the fix.

Auto-resume (``trainer.resume_mode=auto``) refuses a damaged newest checkpoint rather than
falling back to an older one: it names the newest older complete checkpoint and the override
that resumes from it. Falling back would truncate the run's metrics to the older step and later
overwrite the damaged folder, and a checkpoint that was tampered with deserves a person's look;
refusing changes nothing on disk.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from klppo.checkpoint.state import (
    NOT_A_CHECKPOINT, STATE_FILE, WEIGHTS_DIR, checkpoint_steps, load_plain, pointed_step, rank_file, step_dir,
)
from klppo.distributed import read_sharded_contents, requested_keys
from klppo.errors import UserError, reading

KINDS = ("ppo", "sft", "rm")


class IncompatibleCheckpoint(UserError):
    """A sound checkpoint that this run cannot continue (another kind of run, world size, model)."""


_RUN_NAMES = {"ppo": "a PPO run", "sft": "an SFT run", "rm": "a reward-model run",
              "supervised": "an SFT or reward-model run"}
# What each kind of run saves in trainer_state.pt (klppo/run/state.py, supervised.py).
_SHARED_KEYS = {"ppo": ("step", "actor_scheduler", "kl_ctrl", "data", "guard"),
                "sft": ("step", "scheduler", "data"), "rm": ("step", "scheduler", "data")}
_GUARD_KEYS = ("rollbacks", "nonfinite_in_a_row", "good_checkpoints", "pending_checkpoint", "lr_override")
# The fields of a guard event the guard's record may hold (klppo/safety/guards.py, GuardEvent).
_EVENT_FIELDS = {"step": int, "kind": str, "message": str, "values": dict}
# The top-level names of the sharded state (models and optimisers) each kind saves.
_SHARDED_NAMES = {"ppo": ("actor", "actor_optimizer"), "sft": ("model", "optimizer"), "rm": ("model", "optimizer")}


def check_resume_target(folder: str | Path, *, kind: str, world_size: int | None,
                        sharded: dict | Callable[[], dict] | None = None,
                        rank: int | None = None, key: str = "trainer.resume_from_path") -> int:
    """Raise a ``UserError`` unless ``folder`` is a complete checkpoint this run can resume; returns its step.

    ``kind``: "ppo", "sft" or "rm". ``sharded``: the models and optimisers shaped as the run
    will load them (``run_state``'s sharded state), or a function that makes them, called only
    once there is a folder to check (making them materialises a fresh optimiser's state, which
    a run that starts fresh must not do: AdamW would count a step); without it
    only the top-level names are checked. ``rank``: check only this rank's rank file (each
    rank checks its own); None checks them all. ``world_size`` None: any number of ranks may have
    saved it (reading its weights only: ``klppo export``). ``key``: the config key the folder came from.
    Reads only small files and the weights' metadata; no shard is loaded.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{key}: '{folder}' is not a folder; point it at a global_step_N folder of an earlier "
                        f"run, or start fresh with trainer.resume_mode=disable")
    shared = _check_shared_state(folder, kind, key)
    named = re.fullmatch(r"global_step_([0-9]+)", folder.name)
    if named and int(named.group(1)) != shared["step"]:
        raise _not_a_checkpoint(folder / STATE_FILE, f"is the state of step {shared['step']}, not of {folder.name}")
    if world_size is not None:
        _check_rank_files(folder, world_size, rank)
    has_critic = "critic_scheduler" in shared
    if callable(sharded):
        sharded = sharded()
    if sharded is not None and kind == "ppo" and "critic" in sharded and not has_critic:
        raise IncompatibleCheckpoint(
            f"{key}: '{folder}' was saved by a PPO run without a critic and this run trains one; resume with the "
            "estimator that saved it (algorithm.adv_estimator), or start fresh")
    names = _SHARDED_NAMES[kind] + (("critic", "critic_optimizer") if kind == "ppo" and has_critic else ())
    keys = _check_weights(folder)
    if _saved_kind(shared) == "supervised":
        _check_supervised_kind(folder, kind, keys, key)
    _check_keys(folder, keys, names, sharded, key)
    return shared["step"]


def _not_a_checkpoint(path: Path, what: str) -> UserError:
    return UserError(f"checkpoint file '{path}' {what}; {NOT_A_CHECKPOINT}")


def saved_kind(folder: str | Path) -> str | None:
    """"ppo", "sft", "rm" or (an SFT or reward-model checkpoint that did not record which) "supervised"
    for the checkpoint in ``folder``; None where its state file does not say."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise UserError(f"'{folder}' holds no {STATE_FILE}, so it is not a complete klppo checkpoint; point at a "
                        "global_step_N folder of a run, or at the run's folder for its newest checkpoint")
    shared = load_plain(path)
    return _saved_kind(shared) if isinstance(shared, dict) else None


def _saved_kind(shared: dict) -> str | None:
    """The kind recorded by ``save_checkpoint(kind=...)``, else what the keys show ("supervised" for SFT or RM)."""
    if isinstance(shared.get("kind"), str):
        return shared["kind"]
    if "actor_scheduler" in shared:
        return "ppo"
    return "supervised" if "scheduler" in shared else None


def _check_shared_state(folder: Path, kind: str, key: str) -> dict:
    path = folder / STATE_FILE
    if not path.is_file():
        raise UserError(f"{key}: '{folder}' holds no {STATE_FILE}, so it is not a complete klppo checkpoint; "
                        "point it at a global_step_N folder of an earlier run, or start fresh")
    shared = load_plain(path)
    if not isinstance(shared, dict):
        raise _not_a_checkpoint(path, f"holds a {type(shared).__name__}, not a run's state")
    saved = _saved_kind(shared)
    if saved is not None and saved != kind and not (saved == "supervised" and kind != "ppo"):
        raise _other_kind(folder, saved, kind, key)
    missing = [k for k in _SHARED_KEYS[kind] if k not in shared]
    if missing:
        raise _not_a_checkpoint(path, f"has no '{missing[0]}'")
    _check_shared_values(path, shared)
    return shared


def _other_kind(folder: Path, saved: str, kind: str, key: str) -> IncompatibleCheckpoint:
    return IncompatibleCheckpoint(
        f"{key}: '{folder}' is a checkpoint of {_RUN_NAMES.get(saved, saved)}, not of {_RUN_NAMES[kind]}; resume "
        "from this run's own checkpoints, or start fresh (to start from trained weights, point the model path at "
        "the exported Hugging Face folder)")


def _check_supervised_kind(folder: Path, kind: str, keys: dict, key: str) -> None:
    """SFT and reward-model checkpoints saved without a recorded kind differ only in the model's head."""
    if "model.score.weight" in keys and "model.lm_head.weight" not in keys:
        saved = "rm"
    elif "model.lm_head.weight" in keys and "model.score.weight" not in keys:
        saved = "sft"
    else:
        return
    if saved != kind:
        raise _other_kind(folder, saved, kind, key)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _check_shared_values(path: Path, shared: dict) -> None:
    """The values the trainer reads from the shared state have the types it saved (plain data can still lie)."""
    problems = []
    if not (_is_int(shared["step"]) and shared["step"] >= 0):
        problems.append("'step' is not a step number")
    data = shared["data"]
    if not (isinstance(data, dict) and _is_int(data.get("epoch")) and _is_int(data.get("position"))):
        problems.append("'data' is not a data position")
    for name in ("actor_scheduler", "critic_scheduler", "scheduler"):
        if name in shared and not (isinstance(shared[name], dict) and "last_epoch" in shared[name]):
            problems.append(f"'{name}' is not a learning-rate schedule")
    if "kl_ctrl" in shared and not (isinstance(shared["kl_ctrl"], dict)
                                    and type(shared["kl_ctrl"].get("value")) in (int, float)):
        problems.append("'kl_ctrl' is not a KL coefficient")
    if "guard" in shared and not (isinstance(shared["guard"], dict) and all(k in shared["guard"] for k in _GUARD_KEYS)):
        problems.append("'guard' is not a guard record")
    elif "guard" in shared and not _are_events(shared["guard"].get("events", [])):
        problems.append("'guard' holds events that are not guard events")
    elif "guard" in shared and "health" in shared["guard"] and not _is_health_record(shared["guard"]["health"]):
        problems.append("'guard' holds a health record that is not one")
    if problems:
        raise _not_a_checkpoint(path, problems[0])


def _are_events(events: Any) -> bool:
    """A list of dicts with a guard event's fields and types (the record's events are rebuilt from them)."""
    return isinstance(events, list) and all(
        isinstance(e, dict) and set(e) <= set(_EVENT_FIELDS) and all(k in e for k in ("step", "kind", "message"))
        and all(isinstance(v, _EVENT_FIELDS[k]) for k, v in e.items()) for e in events)


def _numbers(values: Any) -> bool:
    return isinstance(values, list) and all(type(v) in (int, float) for v in values)


def _is_health_record(health: Any) -> bool:
    """The run-health detectors' state (klppo/safety/health.py, reward_hacking.py): per model,
    gradient norms (the newest and the run's first) and the steps of skipped spikes; the entropy
    trend's values, the run's first ones, how many it saw and its open episode (or None); the
    divergence detector's validations. Keys added later may be absent (older checkpoints)."""
    if not (isinstance(health, dict) and isinstance(health.get("grads"), dict) and "entropy" in health):
        return False
    grads_ok = all(isinstance(g, dict) and _numbers(g.get("norms")) and _numbers(g.get("skipped_at"))
                   and all(_is_int(s) for s in g["skipped_at"]) and _numbers(g.get("early", []))
                   for g in health["grads"].values())
    entropy = health["entropy"]
    entropy_ok = (isinstance(entropy, dict) and _numbers(entropy.get("values")) and _numbers(entropy.get("early", []))
                  and _is_int(entropy.get("seen", 0))
                  and entropy.get("active", 0) in (None, "entropy_collapse", "entropy_surge"))
    history = health.get("divergence", {}).get("history", []) if isinstance(health.get("divergence"), dict) else None
    divergence_ok = isinstance(history, list) and all(_numbers(row) for row in history)
    return grads_ok and entropy_ok and divergence_ok


def _check_rank_files(folder: Path, world_size: int, rank: int | None) -> None:
    found = sorted(p.name for p in folder.glob("rank_*.pt"))
    if len(found) != world_size:
        raise IncompatibleCheckpoint(
            f"checkpoint {folder} was not saved by {world_size} rank(s) (it holds {len(found)} rank files); "
            "resume it with the number of processes that saved it")
    expected = sorted(rank_file(folder, r).name for r in range(world_size))
    if found != expected:
        odd = next(name for name in found if name not in expected)
        raise _not_a_checkpoint(folder / odd, f"does not belong to a checkpoint of {world_size} rank(s)")
    for r in range(world_size) if rank is None else (rank,):
        path = rank_file(folder, r)
        state = load_plain(path)
        if not (isinstance(state, dict) and _is_rng_state(state.get("rng"))):
            raise _not_a_checkpoint(path, "holds no RNG states")


def _is_rng_state(rng: Any) -> bool:
    """The shape ``klppo.checkpoint.state.rng_state`` writes."""
    if not isinstance(rng, dict):
        return False
    py, npy = rng.get("python"), rng.get("numpy")
    return (
        _is_tensor(rng.get("torch"), torch.uint8)
        and isinstance(py, dict) and _is_int(py.get("version")) and _is_tensor(py.get("keys"), torch.int64, 625)
        and isinstance(npy, dict) and isinstance(npy.get("name"), str) and _is_tensor(npy.get("keys"), torch.int64, 624)
        and _is_int(npy.get("pos")) and _is_int(npy.get("has_gauss"))
        and ("cuda" not in rng or _is_tensor(rng["cuda"], torch.uint8))
    )


def _is_tensor(value: Any, dtype: torch.dtype, numel: int | None = None) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() == 1
            and (numel is None or value.numel() == numel))


def _check_weights(folder: Path) -> dict[str, tuple[int, ...] | None]:
    """The saved keys (and shapes) after checking that the metadata loads and every shard is whole."""
    weights = folder / WEIGHTS_DIR
    metadata = weights / ".metadata"
    if not metadata.is_file():
        raise UserError(f"'{folder}' has no {WEIGHTS_DIR}/.metadata, so the checkpoint is incomplete; "
                        "resume from another checkpoint or start fresh")
    with reading(metadata, "checkpoint file", NOT_A_CHECKPOINT):
        contents = read_sharded_contents(weights)
    for name, length in sorted(contents.files.items()):
        shard = weights / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < length:
            state = "is missing" if size is None else f"is truncated ({size} of {length} bytes)"
            raise UserError(f"checkpoint shard '{shard}' {state}; the checkpoint is damaged: resume from another "
                            "checkpoint or start fresh")
    return contents.keys


def _check_keys(folder: Path, keys: dict, names: Iterable[str], sharded: dict | None, key: str) -> None:
    """Every key the run will load is saved, with the shape the run expects (or, without ``sharded``,
    every top-level name)."""
    missing = [n for n in names if not any(k.startswith(n + ".") for k in keys)]
    wanted = requested_keys(sharded) if sharded is not None else {}
    missing += [k for k in wanted if k not in keys]
    if missing:
        raise IncompatibleCheckpoint(
            f"{key}: the weights in '{folder}' have no '{missing[0]}': they were saved by another kind of run or "
            "for another model; resume with the config that saved them, or start fresh")
    for want, shape in wanted.items():
        if keys[want] != shape:
            raise IncompatibleCheckpoint(
                f"{key}: '{want}' in '{folder}' has shape {list(keys[want] or [])}, this run's has "
                f"{list(shape or [])}; resume with the model that saved it, or start fresh")


def find_resume_folder(run_dir: str | Path, mode: str, path: str | None, *, kind: str, world_size: int,
                       sharded: dict | Callable[[], dict] | None = None, rank: int | None = None) -> Path | None:
    """The checkpoint a run continues from (``trainer.resume_mode``), checked whole; None for a fresh start.

    ``resume_path`` refuses a bad ``path``. ``auto`` resumes from the checkpoint that
    ``latest_checkpointed_iteration.txt`` names; a damaged pointer or checkpoint is refused with
    the newest complete checkpoint that remains and the override that resumes from it (nothing
    falls back silently). No pointer file: a fresh start.
    """
    checks = dict(kind=kind, world_size=world_size, sharded=sharded, rank=rank)
    if mode == "disable":
        return None
    if mode == "resume_path":
        if not path:
            raise UserError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)")
        check_resume_target(path, **checks)
        return Path(path)
    if mode != "auto":
        raise UserError(f"trainer.resume_mode must be auto, disable or resume_path, not '{mode}'")
    newest = None
    try:
        step = pointed_step(run_dir)
        if step is None:
            return None
        newest = step_dir(run_dir, step)
        if not newest.is_dir():
            raise UserError(f"the checkpoint pointer names step {step}, but '{newest}' does not exist")
        check_resume_target(newest, key="trainer.resume_mode=auto", **checks)
        return newest
    except IncompatibleCheckpoint:
        raise  # an older checkpoint of the same run would not fit either
    except UserError as damage:
        older = newest_complete_checkpoint(run_dir, skip=newest, **checks)
        then = (f"the newest complete checkpoint is {older}: resume from it with trainer.resume_mode=resume_path "
                f"trainer.resume_from_path={older}" if older is not None else
                "no complete checkpoint is left: start fresh with trainer.resume_mode=disable or in another "
                "trainer.default_local_dir")
        raise UserError(f"trainer.resume_mode=auto: the newest checkpoint is damaged: {damage}\n{then}") from damage


def newest_complete_checkpoint(run_dir: str | Path, skip: Path | None = None, **checks) -> Path | None:
    """The newest checkpoint folder in ``run_dir`` (other than ``skip``) that passes ``check_resume_target``."""
    for step in reversed(checkpoint_steps(run_dir)):
        folder = step_dir(run_dir, step)
        if skip is not None and folder == skip:
            continue
        try:
            check_resume_target(folder, **checks)
        except UserError:
            continue
        return folder
    return None
