"""FSDP2 wrapping over a data-parallel device mesh (torchtitan's ``parallelize`` in one function).

Gradients are SUMMED over ranks, not averaged: every rank's loss is already normalised by the
global mini-batch token (or sequence) count (``klppo.trainer.update``), so the sum of the
per-rank gradients is the gradient of the global mini-batch, whatever the world size.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable, Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def build_mesh(world_size: int, fsdp_size: int = -1, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D ("fsdp",) mesh over all ranks, or a 2-D HSDP ("replicate", "shard") mesh.

    ``fsdp_size`` (verl's ``actor.fsdp_config.fsdp_size``): -1, or ``world_size`` or more (as
    verl's ``create_device_mesh`` reads it), shards over every rank; a smaller divisor shards
    within groups of that size and replicates across them.
    """
    if fsdp_size == -1 or fsdp_size >= world_size:
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
    replicate_frozen_root: bool = False,
) -> torch.nn.Module:
    """``fully_shard`` each decoder block (``model._no_split_modules``), then the root; returns ``model``.

    ``keep_root_gathered``: the root's own parameters (embeddings, final norm, head) stay
    gathered from forward to backward. Needed when the loss is built from an intermediate
    output (a reward model's per-position scores) rather than the root's output, whose
    backward hook would otherwise gather them again.

    ``replicate_frozen_root``: the root's frozen parameters (a LoRA model's embeddings and final
    norm) stay whole on every rank instead of sharded, when they compute in their own dtype
    (no ``param_dtype``). FSDP2 gathers the root whole for the whole forward and backward, and
    while gathering it holds the parameters twice (its all-gather buffer, then the copy out):
    for a 0.5B model's tied fp32 embedding, 1.09 GB at the peak of each rank instead of 0.55 GB
    kept whole, and no all-gather of it per forward. Under mixed precision the gathered copy is
    in the (half as large) compute dtype, so sharding costs no more at the peak and is kept.
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
        # Pinned host memory speeds the copies to a GPU; pinning needs a CUDA context, which a CPU run must not make.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"no module of {type(model).__name__} is one of its _no_split_modules {sorted(block_names)}")
    for block in blocks:
        fully_shard(block, **kwargs)
    root_kwargs = {**kwargs, "reshard_after_forward": reshard_after_forward and not keep_root_gathered}
    # Under offload_policy FSDP2 brings to the device only the parameters it manages: ignored ones
    # would stay on CPU, where materialize puts every parameter, and the forward would fail.
    if replicate_frozen_root and param_dtype is None and not cpu_offload:
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        root_kwargs["ignored_params"] = {p for p in model.parameters() if not p.requires_grad and id(p) not in in_blocks}
    fully_shard(model, **root_kwargs)
    # Sum, not average: a divide factor of 1, and plain SUM collectives (gloo has no PREMUL_SUM).
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model


def parameter_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where a sharded model's parameters live: on CPU under FSDP2's offload policy (``apply_fsdp2``'s
    ``cpu_offload``), which copies each unit to ``device`` for its computation and refuses
    parameters found elsewhere at the first forward; on ``device`` otherwise."""
    return torch.device("cpu") if cpu_offload else device


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give a model built with its parameters on the meta device (and sharded) empty parameters on
    ``device`` (``parameter_device``) -- each rank only its shards -- and keep its buffers' values
    and places (rotary frequencies and the like are computed at construction, not loaded, and
    ``fully_shard`` moved them to the mesh's device, which computes with them even when the
    parameters live on CPU; ``fill_sharded`` then reads the persistent ones) and its tied
    parameters tied."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers(remove_duplicate=False)}
    aliases = tied_aliases(model)
    model.to_empty(device=device)
    for name, saved in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = saved
    for name, others in aliases.items():  # a parameter FSDP2 left whole gets one new tensor per module: tie them again
        for alias in others:
            owner, _, leaf = alias.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = model.get_parameter(name)


def tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """The first name of every parameter the model holds under several names (tied embeddings:
    ``model.embed_tokens.weight``) -> its other names (``lm_head.weight``)."""
    first_name: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases.setdefault(first_name[id(param)], []).append(name)
        first_name.setdefault(id(param), name)
    return aliases


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> each buffer the state dict holds (a trained value such as DeepSeek-V3's router
    ``e_score_correction_bias``, read from the folder), in the model's order; computed ones
    (rotary frequencies, ``persistent=False``) are left out. FSDP2 never shards buffers."""
    return {f"{prefix}{'.' if prefix else ''}{leaf}": buffer
            for prefix, module in model.named_modules()
            for leaf, buffer in module._buffers.items()
            if buffer is not None and leaf not in module._non_persistent_buffers_set}


@torch.no_grad()
def fill_sharded(model: torch.nn.Module, tensor_of: Callable[[str], torch.Tensor] | None) -> None:
    """Fill every parameter and persistent buffer from the full tensor ``tensor_of(name)`` that rank 0
    provides (None elsewhere).

    One tensor at a time: rank 0 reads it, and each rank keeps its own shard of it
    (``distribute_tensor`` scatters or broadcasts from rank 0 over the parameter's mesh), so no
    rank ever holds more than one whole tensor. A parameter FSDP2 leaves whole
    (``replicate_frozen_root``) and every persistent buffer are broadcast: ``materialize`` kept the
    buffers' values as built, which for a trained buffer are its initial ones, not the folder's.
    Without a process group the model is filled as is.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    for name, buffer in persistent_buffers(model).items():
        _fill_whole(buffer, name, tensor_of, rank0)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):  # whole on every rank (no process group, or replicated)
            _fill_whole(param, name, tensor_of, rank0)
            continue
        mesh = param.device_mesh
        if rank0:
            full = tensor_of(name).to(device=mesh.device_type, dtype=param.dtype)
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=mesh.device_type)
        param.to_local().copy_(distribute_tensor(full, mesh, param.placements, src_data_rank=0).to_local())
        del full


def _fill_whole(tensor: torch.Tensor, name: str, tensor_of, rank0: bool) -> None:
    """Copy rank 0's ``tensor_of(name)`` into ``tensor``, which every rank holds whole."""
    if dist.is_initialized():
        tensor.copy_(tensor_of(name) if rank0 else torch.empty_like(tensor))
        dist.broadcast(tensor, src=0)
    else:
        tensor.copy_(tensor_of(name))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) parameters on CPU, on rank 0 (an empty dict elsewhere); call on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model wrapped by ``apply_fsdp2``."""
    return isinstance(model, FSDPModule)


def plain_class(model: torch.nn.Module) -> type:
    """The model's own class (``fully_shard`` swaps it for an ``FSDP<Name>`` subclass)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


@torch.no_grad()
def inference_copy(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device,
                   prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """A plain, whole model of a sharded Hugging Face model's weights on every rank, in ``dtype``
    (its compute dtype), for generation: decoding with it runs no FSDP2 hook and no collective
    (verl's hybrid engine, without an inference server). Collective. ``prepare``: as in
    ``plain_copy`` (a LoRA copy's adapters).

    A parameter this rank already holds whole (``whole_locally``: one process's group of one, an
    HSDP replica) is taken as it is when it is in ``dtype`` on ``device`` -- the model shares it,
    nothing is copied -- and cast or moved otherwise. Through the FSDP2 model itself every
    generated token ran each unit's pre- and post-forward hooks (one process, H200: 8,942 hooks and
    10 s of unshard waits in one step's generation); with every unit held unsharded the hooks still
    cost about 0.3 ms per unit per token on CPU (``benchmarks/README.md``, "Generation weights").

    Sharded parameters are all-gathered once here, as a forward would, one unit at a time: its
    parameters are copied and it is resharded before the next is gathered, so building the copy
    peaks at the copy plus one unit, not at two whole models (every unit gathered at once, then
    copied: measured on 2 ranks of a 0.5B model, 6.0 GiB per rank at generation where the plan's
    copy-plus-cache estimate was 4.2).
    """
    params = {name: tensor if lasting else tensor.clone() for name, tensor, lasting in whole_parameters(model, dtype, device)}
    return plain_copy(model, params, prepare)


def whole_parameters(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device
                     ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, whole tensor in ``dtype`` on ``device``, whether it lasts) of every parameter of a
    (sharded) model, tied ones once; collective (every rank iterates to the end).

    A lasting tensor is the rank's own parameter, held whole in ``dtype`` on ``device``, or a cast or
    moved tensor of its own; one that does not is a gathered unit's parameter, valid only until the
    next item, when the unit is resharded (copy it, or copy from it). The parameters this rank holds
    whole come first, then each sharded unit's, one unit gathered at a time.
    """
    reshard(model)  # a unit left gathered by a forward holds plain tensors in its compute dtype
    done = set()
    for name, param in model.named_parameters():
        if whole_locally(param):
            done.add(name)
            yield name, _local(param).detach().to(device=device, dtype=dtype or param.dtype), True
    if len(done) == _count(model):
        return
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.unshard()
        try:  # while unsharded, the unit's parameters are plain, whole tensors (in FSDP2's compute dtype)
            for name, param in model.named_parameters():  # tied parameters come once
                if name not in done and not isinstance(param, DTensor):
                    done.add(name)
                    whole = param.detach()
                    cast = whole.to(device=device, dtype=dtype or param.dtype)
                    yield name, cast, cast is not whole
        finally:
            unit.reshard()


@torch.no_grad()
def load_in_place(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``weights`` (name, whole tensor) into ``model``'s parameters of those names, each keeping its
    storage (a CUDA graph recorded on their addresses replays on the new values); a tensor that is
    the parameter itself is skipped. Every parameter must be given (tied ones once)."""
    targets, filled = dict(model.named_parameters()), 0
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            continue  # a buffer, or a name the model does not take (as in ``plain_copy``'s load)
        if target.data_ptr() != tensor.data_ptr():
            target.copy_(tensor)
        filled += 1
    assert filled == len(targets), f"{len(targets) - filled} of {len(targets)} parameters were not given"


def inference_copy_bytes(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device) -> int:
    """Bytes ``inference_copy`` allocates on this rank: every parameter it cannot share (gathered,
    cast to ``dtype`` or moved to ``device``); 0 for one process computing in its parameters' dtype."""
    reshard(model)
    total = 0
    for param in model.parameters():
        local = _local(param)
        shared = whole_locally(param) and local.dtype == (dtype or param.dtype) and local.device == device
        total += 0 if shared else param.numel() * torch.finfo(dtype or param.dtype).bits // 8
    return total


def whole_locally(param: torch.Tensor) -> bool:
    """Whether this rank holds ``param`` whole: a plain tensor, or a DTensor sharded only over mesh
    dimensions of one rank (a process group of one; HSDP's ``fsdp_size: 1``). The same answer on
    every rank, so ranks agree on which units ``inference_copy`` gathers."""
    if not isinstance(param, DTensor):
        return True
    mesh = param.device_mesh
    return all(p.is_replicate() or mesh.size(dim) == 1 for dim, p in enumerate(param.placements))


def _count(model: torch.nn.Module) -> int:
    return sum(1 for _ in model.named_parameters())


def plain_copy(model: torch.nn.Module, params: dict[str, torch.Tensor],
               prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """A plain model of ``model``'s own class and config (built on the meta device) that takes
    ``params`` (whole tensors by name) as its parameters and ``model``'s buffers, for inference
    (eval mode, nothing trains). ``prepare(copy)`` runs on the empty copy first, so that it fits
    ``params`` (gives it a LoRA model's adapters). The copy shares no memory with ``model`` as
    long as ``params`` do not; drop it after use to free it.
    """
    with torch.device("meta"):
        copy = plain_class(model)(model.config)
    if prepare is not None:
        prepare(copy)
    copy.load_state_dict(params, strict=False, assign=True)
    for name, buffer in model.named_buffers():  # buffers are not sharded (rotary frequencies and the like)
        owner, _, leaf = name.rpartition(".")
        copy.get_submodule(owner)._buffers[leaf] = buffer.detach().clone()
    copy.tie_weights()
    missing = [n for n, p in copy.named_parameters() if p.device.type == "meta"]
    assert not missing, f"inference copy left {missing[:3]} unfilled"
    if getattr(model, "generation_config", None) is not None:
        copy.generation_config = model.generation_config
    return copy.eval().requires_grad_(False)


def reshard(model: torch.nn.Module) -> None:
    """Free the whole parameters FSDP2 still holds from a forward (``reshard_after_forward=False``,
    a root kept gathered): afterwards every module computes from its shards again, so values
    written into the shards are the ones the next forward gathers. No-op for a plain model."""
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.reshard()


def whole_tensor_groups(model: torch.nn.Module, device: torch.device | None = None, *, copies: bool = True
                        ) -> Iterator[dict[str, torch.Tensor]]:
    """The model's parameters (then its persistent buffers) as whole CPU tensors on rank 0, a group
    at a time: the parameters of one decoder block (``_no_split_modules``), or a run of the
    root's own (embeddings, final norm, heads); tied parameters come once, by their first name.
    Collective: every rank iterates to the end (each sharded parameter is one all-gather, and
    no rank holds more than one whole tensor of it); other ranks get empty groups.

    A model that is not sharded gives its own tensors (no copy on CPU). ``device``: every rank
    gets the groups, on ``device``, and as copies (a generation copy's weights), or with
    ``copies=False`` the model's own tensors where they are already there (a consumer that copies
    them itself: an inference engine loading its weights; for a 0.5B model in one process the
    needless copy was a third of the sync).
    """
    reshard(model)  # a root kept gathered after a forward (keep_root_gathered) holds plain tensors
    keep = device is not None or not dist.is_initialized() or dist.get_rank() == 0
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [f"{name}." for name, m in model.named_modules() if plain_class(m).__name__ in block_names]
    group, current = {}, None
    for name, param in model.named_parameters():
        owner = next((prefix for prefix in blocks if name.startswith(prefix)), "")
        if owner != current and group:
            yield group
            group = {}
        current = owner
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        if keep:
            group[name] = _kept(whole, device, shared=copies and whole.data_ptr() == _local(param).data_ptr())
        del whole
    buffers = persistent_buffers(model)
    if keep and buffers:
        group.update({name: _kept(b, device, shared=copies) for name, b in buffers.items()})
    if group:
        yield group


def _kept(tensor: torch.Tensor, device: torch.device | None, *, shared: bool) -> torch.Tensor:
    """A whole tensor as a group holds it: on rank 0's CPU, or on ``device`` as a tensor of its own
    (``shared``: it is the model's own memory; a gathered one is new, and copying it again would
    hold a large embedding twice)."""
    if device is None:
        return tensor.detach().to("cpu")
    return tensor.detach().to(device, copy=shared)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


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
    plain_cls = plain_class(model)
    with torch.device("meta"):
        plain = plain_cls(model.config)
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(plain, "all_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"gathered state does not fit {plain_cls.__name__}: missing {sorted(set(missing) - tied)}, "
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
