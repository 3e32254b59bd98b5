"""FSDP2 wrapping over a data-parallel device mesh (torchtitan's ``parallelize`` in one function).

Gradients are SUMMED over ranks, not averaged: every rank's loss is already normalised by the
global mini-batch token (or sequence) count (``klppo.trainer.update``), so the sum of the
per-rank gradients is the gradient of the global mini-batch, whatever the world size.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def build_mesh(world_size: int, fsdp_size: int = -1, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D ("fsdp",) mesh over all ranks, or a 2-D HSDP ("replicate", "shard") mesh.

    ``fsdp_size`` (verl's ``actor.fsdp_config.fsdp_size``): -1 or ``world_size`` shards over
    every rank; a smaller divisor shards within groups of that size and replicates across them.
    """
    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if fsdp_size < 1 or world_size % fsdp_size:
        raise ValueError(
            f"fsdp_size={fsdp_size} must be -1 or a divisor of the world size {world_size}; "
            f"set fsdp_config.fsdp_size to -1 to shard over all ranks"
        )
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


def apply_fsdp2(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    keep_root_gathered: bool = False,
) -> torch.nn.Module:
    """``fully_shard`` each decoder block (``model._no_split_modules``), then the root; returns ``model``.

    ``keep_root_gathered``: the root's own parameters (embeddings, final norm, head) stay
    gathered from forward to backward. Needed when the loss is built from an intermediate
    output (a reward model's per-position scores) rather than the root's output, whose
    backward hook would otherwise gather them again.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    if not block_names:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules; cannot tell its decoder blocks")
    # Hugging Face value heads return views; klppo never modifies model outputs in place (the
    # 2-rank == 1-process tests compare the resulting gradients), so FSDP2's warning is noise.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"no module of {type(model).__name__} is one of its _no_split_modules {sorted(block_names)}")
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": reshard_after_forward and not keep_root_gathered})
    # Sum, not average: a divide factor of 1, and plain SUM collectives (gloo has no PREMUL_SUM).
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) parameters on CPU, on rank 0 (an empty dict elsewhere); call on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model wrapped by ``apply_fsdp2``."""
    return isinstance(model, FSDPModule)


def gather_full_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """A plain, unsharded CPU copy of a Hugging Face model on rank 0 (None elsewhere); collective.

    The copy is built on the meta device and takes the gathered tensors as its parameters
    (``assign``): no random initialisation and no second full copy, which for a large model
    took rank 0 minutes while the other ranks waited at the next collective. Buffers outside
    the state dict (rotary frequencies) are copied from ``model``, which FSDP2 leaves whole;
    tied embeddings are tied again. ``fully_shard`` swaps the model's class for an
    ``FSDP<Name>`` subclass, which ``save_pretrained`` would record as the architecture; the
    copy has the original class.
    """
    state = full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    plain_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        plain = plain_class(model.config)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(plain, "all_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"gathered state does not fit {plain_class.__name__}: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    whole = dict(model.named_buffers())
    for name, buffer in list(plain.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            plain.get_submodule(owner).register_buffer(leaf, whole[name].detach().to("cpu", copy=True),
                                                       persistent=False)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    return plain
