"""Save and resume the complete state of a run; export the actor as a Hugging Face folder.

Layout of a run directory (verl's names where verl has one)::

    <default_local_dir>/
        latest_checkpointed_iteration.txt     the newest complete step, e.g. "20"
        global_step_20/
            trainer_state.pt                  step, schedulers, KL controller, data position,
                                              guard record (written by rank 0)
            weights/                          models and optimisers, one DCP shard per rank
            rank_0.pt, rank_1.pt, ...         each rank's RNG states
        metrics.jsonl
        actor_hf/                             exported at the end of the run

A checkpoint is written to ``global_step_N.tmp`` and renamed into place, and only then is the
pointer file replaced (also by rename), so a crash mid-save leaves the previous checkpoint and
pointer intact. Every rank takes part in saving and loading; with one process the same layout
holds one shard.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from klppo.distributed import SINGLE_PROCESS, DistEnv, barrier, gather_full_model, is_sharded, load_sharded, save_sharded
from klppo.errors import UserError

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
WEIGHTS_DIR = "weights"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"global_step_{step}"


def rng_state() -> dict[str, Any]:
    """Every RNG a step draws from: torch (CPU and CUDA), Python, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rank_file(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank_{rank}.pt"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    *,
    sharded: dict[str, Any] | None = None,
    rank_state: dict[str, Any] | None = None,
    env: DistEnv = SINGLE_PROCESS,
    keep: int | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; every rank calls this.

    ``state`` is the run's shared state (written by rank 0), ``sharded`` the models and
    optimisers (each rank writes its shards), ``rank_state`` what differs per rank (RNG).
    Keeps only the newest ``keep`` checkpoints if set.
    """
    run_dir = Path(run_dir)
    final = step_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if sharded is not None:
        save_sharded(sharded, tmp / WEIGHTS_DIR)
    if rank_state is not None:
        torch.save(rank_state, rank_file(tmp, env.rank))
    barrier()
    if env.rank == 0:
        torch.save(state, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomically(run_dir / LATEST_FILE, str(step))
        if keep is not None:
            _prune(run_dir, keep)
    barrier()
    return final


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``, oldest first (``.tmp`` folders skipped)."""
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in Path(run_dir).glob("global_step_*") if p.name[-1].isdigit())


def _prune(run_dir: Path, keep: int) -> None:
    steps = checkpoint_steps(run_dir)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)


def resume_folder(run_dir: str | Path, resume_mode: str, resume_from_path: str | None) -> Path | None:
    """The checkpoint a run continues from (``trainer.resume_mode``), or None for a fresh start."""
    if resume_mode == "auto":
        return latest_checkpoint(run_dir)
    if resume_mode == "resume_path":
        return Path(resume_from_path)
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint the pointer file names, or None if the run has none."""
    pointer = Path(run_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    folder = step_dir(run_dir, int(pointer.read_text().strip()))
    return folder if (folder / STATE_FILE).is_file() else None


def load_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The shared state saved in checkpoint ``folder`` (a ``global_step_N`` directory)."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise UserError(
            f"trainer.resume_from_path: '{folder}' holds no {STATE_FILE}; "
            "point it at a global_step_N folder of an earlier run"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def load_sharded_state(folder: str | Path, sharded: dict[str, Any]) -> None:
    """Fill ``sharded`` (shaped like what was saved) from checkpoint ``folder``; every rank calls this."""
    load_sharded(sharded, Path(folder) / WEIGHTS_DIR)


def load_rank_state(folder: str | Path, env: DistEnv) -> dict[str, Any]:
    """This rank's own saved state; a checkpoint from a different world size is refused."""
    path = rank_file(Path(folder), env.rank)
    if len(list(Path(folder).glob("rank_*.pt"))) != env.world_size:
        raise UserError(
            f"checkpoint {folder} was not saved by {env.world_size} rank(s); resume it with the number of "
            "processes that saved it"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def export_hf(model, tokenizer, out_dir: str | Path, env: DistEnv = SINGLE_PROCESS) -> Path:
    """Write ``model`` and ``tokenizer`` as a folder that ``from_pretrained`` loads.

    Every rank calls this: a sharded model is gathered whole onto rank 0, which writes.
    """
    out = Path(out_dir)
    if is_sharded(model):
        model = gather_full_model(model)
    if env.rank == 0:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    barrier()
    return out
