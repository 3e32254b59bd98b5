"""Sharded checkpoints of models and optimisers with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only its own shards into one folder, and reads back whatever shards it needs,
so a checkpoint costs every rank its share and never gathers a model onto one rank. The same
calls serve a single process without a process group (plain modules, one shard file).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimiser) state dicts keyed by parameter names, sharded as the model is.

    The optimiser's state is materialised if it has not stepped yet, so the dicts are also the
    right shape to load a checkpoint into.
    """
    return get_state_dict(model, optimizer)


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optimizer_state: dict) -> None:
    """Put ``training_state`` dicts (e.g. filled by ``load_sharded``) back into the model and optimiser."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save_sharded(state: dict, folder: str | Path) -> None:
    """Write ``state`` (nested dicts of tensors / DTensors) as a DCP checkpoint; collective."""
    with warnings.catch_warnings():  # one process without a group is intended, not an accident
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(folder), no_dist=_single_process())


def load_sharded(state: dict, folder: str | Path) -> None:
    """Fill ``state`` in place from the DCP checkpoint in ``folder``; collective."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=_single_process())
