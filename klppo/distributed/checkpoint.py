"""Sharded checkpoints of models and optimisers with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only its own shards into one folder, and reads back whatever shards it needs,
so a checkpoint costs every rank its share and never gathers a model onto one rank. The same
calls serve a single process without a process group (plain modules, one shard file). Loading
runs no code from the checkpoint (``klppo.distributed.dcp_reader``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from klppo.distributed.dcp_reader import METADATA_FILE, SafeFileSystemReader, WeightsOnlyLoadPlanner
from klppo.errors import reading


def _trained_only(model: torch.nn.Module) -> StateDictOptions:
    """Frozen parameters (a LoRA model's base weights) come from the model folder at every start: a
    checkpoint holds what trains (for LoRA the adapters, and a new head) and its optimiser state.
    Loading then leaves the frozen ones as they are (not strict) where there are any."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimiser) state dicts keyed by parameter names, sharded as the model is, of the
    parameters that train (every one, in full fine-tuning).

    The optimiser's state is materialised if it has not stepped yet, so the dicts are also the
    right shape to load a checkpoint into.
    """
    options = _trained_only(model)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if not options.strict:  # DCP drops frozen parameters by their first name only, not a tied alias (lm_head)
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        model_state = {key: value for key, value in model_state.items() if key not in frozen}
    return model_state, optimizer_state


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optimizer_state: dict) -> None:
    """Put ``training_state`` dicts (e.g. filled by ``load_sharded``) back into the model and optimiser."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=_trained_only(model))


def model_training_state(model: torch.nn.Module) -> dict:
    """``training_state``'s model dict alone: what a checkpoint holds of the model, to read it
    without an optimiser (exporting a checkpoint's weights)."""
    options = _trained_only(model)
    state = get_state_dict(model, optimizers=(), options=options)[0]
    if not options.strict:
        frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = {key: value for key, value in state.items() if key not in frozen}
    return state


def load_model_training_state(model: torch.nn.Module, model_state: dict) -> None:
    """Put a ``model_training_state`` dict (filled by ``load_sharded``) back into the model."""
    set_state_dict(model, optimizers=(), model_state_dict=model_state, optim_state_dict={},
                   options=_trained_only(model))


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _writer(state: dict, folder: str | Path) -> dcp.FileSystemWriter:
    """DCP's writer for ``state``: copying ahead through a CUDA stream when a tensor is on CUDA, serially
    otherwise. DCP's default copies ahead whenever CUDA is available, and asking for the stream creates
    a CUDA context: a CPU run on a GPU host would take GPU memory to save CPU tensors."""
    flat, _ = flatten_state_dict(state)
    locals_ = (v.to_local() if isinstance(v, DTensor) else v for v in flat.values())
    if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in locals_):
        return dcp.FileSystemWriter(str(folder))
    return dcp.FileSystemWriter(str(folder), per_thread_copy_ahead=0)  # 0: DCP's serial loader


def save_sharded(state: dict, folder: str | Path) -> None:
    """Write ``state`` (nested dicts of tensors / DTensors) as a DCP checkpoint; collective."""
    with warnings.catch_warnings():  # one process without a group is intended, not an accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=_writer(state, folder), no_dist=_single_process())


def load_sharded(state: dict, folder: str | Path) -> None:
    """Fill ``state`` in place from the DCP checkpoint in ``folder``; collective.

    A checkpoint that cannot be read is a ``UserError`` naming the file (the metadata) or the
    folder (DCP wraps each rank's failure in a ``CheckpointException``; the first cause is shown).
    """
    fix = "this is not a klppo checkpoint or was modified; resume from another checkpoint or start fresh"
    reader = SafeFileSystemReader(str(folder))
    # Read once up front: inside dcp.load a failed metadata read is logged with a traceback.
    with reading(Path(folder) / METADATA_FILE, "checkpoint file", fix):
        reader.read_metadata()
    with reading(folder, "checkpoint weights", fix), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=_single_process())
        except CheckpointException as exc:  # a BaseException: unwrap it so that reading() sees the cause
            causes = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
            raise (causes[0] if causes else RuntimeError(str(exc))) from exc
