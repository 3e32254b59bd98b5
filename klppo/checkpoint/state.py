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
        actor_hf/                             exported at the end of the run (klppo.checkpoint.export)

Everything outside ``weights/`` is plain data (tensors, numbers, strings, lists, dicts; the
RNG states as tensors), written and read back with ``torch.load(weights_only=True)``, so a
checkpoint from anywhere loads without running code (``weights/`` is read the same way, see
``klppo.distributed.dcp_reader``). ``klppo.checkpoint.verify`` checks a resume target whole
before a run loads or writes anything.

A checkpoint is written to ``global_step_N.tmp`` and renamed into place, and only then is the
pointer file replaced (also by rename), so a crash mid-save leaves the previous checkpoint and
pointer intact. Every rank takes part in saving and loading; with one process the same layout
holds one shard.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from klppo.distributed import (
    SINGLE_PROCESS, DistEnv, barrier, load_sharded, save_sharded,
)
from klppo.errors import UserError, reading

LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
WEIGHTS_DIR = "weights"
NOT_A_CHECKPOINT = "this file is not a klppo checkpoint or was modified; resume from another checkpoint or start fresh"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"global_step_{step}"


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG a step draws from (torch CPU, Python, NumPy, this rank's CUDA device), as plain data.

    ``device``: the rank's CUDA device; by default the current one, if CUDA is in use. Only this
    rank's own device is saved, so a checkpoint resumes on any number of visible devices.
    """
    py_version, py_keys, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": py_version, "keys": torch.tensor(py_keys, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {"name": str(np_name), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore ``rng_state()``; the CUDA state goes to ``device`` (by default the current one)."""
    torch.set_rng_state(state["torch"])
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["keys"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["gauss"]))
    # A CPU run never touches CUDA (a context would take GPU memory), even resuming a GPU run's state.
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if "cuda" in state and on_cuda:
        torch.cuda.set_rng_state(state["cuda"], device if device is not None else "cuda")


_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.nn.Parameter)


def check_plain(obj: Any, where: str = "state") -> None:
    """Raise TypeError unless ``obj`` is plain data that ``torch.load(weights_only=True)`` reads back.

    Types are matched exactly: NumPy's float64 is a float subclass that weights_only refuses.
    """
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not a str or int")
            check_plain(value, f"{where}.{key}")
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
    elif type(obj) not in _PLAIN:
        raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint holds plain data only")


def load_plain(path: str | Path) -> Any:
    """The plain data in checkpoint file ``path``; anything else is refused without running it."""
    with reading(path, "checkpoint file", NOT_A_CHECKPOINT), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's advice about a foreign file's pickle protocol; the error says it
        return torch.load(path, map_location="cpu", weights_only=True)


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
    kind: str | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically; every rank calls this.

    ``state`` is the run's shared state (written by rank 0), ``sharded`` the models and
    optimisers (each rank writes its shards), ``rank_state`` what differs per rank (RNG); both
    must be plain data (``check_plain``). ``kind`` ("ppo", "sft", "rm") is recorded in the
    shared state, so a resume can refuse another kind's checkpoint by name.
    Keeps only the newest ``keep`` checkpoints if set.
    """
    if kind is not None:
        state = {**state, "kind": kind}
    check_plain(state, STATE_FILE)
    if rank_state is not None:
        check_plain(rank_state, f"rank_{env.rank}.pt")
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
    """The steps of the checkpoint folders in ``run_dir``, oldest first (``.tmp`` folders skipped)."""
    names = (re.fullmatch(r"global_step_([0-9]+)", p.name) for p in Path(run_dir).glob("global_step_*") if p.is_dir())
    return sorted(int(m.group(1)) for m in names if m)


def _prune(run_dir: Path, keep: int) -> None:
    steps = checkpoint_steps(run_dir)
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)


def pointed_step(run_dir: str | Path) -> int | None:
    """The step the pointer file names, or None if there is no pointer file; a damaged one is a UserError."""
    pointer = Path(run_dir) / LATEST_FILE
    if not pointer.exists():
        return None
    fix = "it should hold the step of the newest checkpoint, e.g. 20"
    with reading(pointer, "the checkpoint pointer", fix):
        text = pointer.read_text(encoding="ascii").strip()
    if not re.fullmatch(r"[0-9]{1,12}", text):
        raise UserError(f"the checkpoint pointer '{pointer}' holds {text[:20]!r}, not a step number; {fix}")
    return int(text)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint the pointer file names, or None if the run has none."""
    step = pointed_step(run_dir)
    if step is None:
        return None
    folder = step_dir(run_dir, step)
    return folder if (folder / STATE_FILE).is_file() else None


def load_checkpoint(folder: str | Path) -> dict[str, Any]:
    """The shared state saved in checkpoint ``folder`` (a ``global_step_N`` directory)."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise UserError(
            f"trainer.resume_from_path: '{folder}' holds no {STATE_FILE}; "
            "point it at a global_step_N folder of an earlier run"
        )
    return load_plain(path)


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
    return load_plain(path)
