"""What every run sets up the same way, PPO, SFT and reward-model training alike: seeds, the
process group, FSDP2 sharding, and the optimiser with its learning-rate schedule.

Each builder takes flat arguments or one config section; none reads the whole config.
"""

from __future__ import annotations

import ctypes
import math
import os
import random
import tempfile
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from klppo.config.lora import lora_enabled
from klppo.config.optimizers import TORCH_OPTIM, optimizer_class, takes_betas
from klppo.config.schema import FSDPConfig, LoraKeys, OptimConfig
from klppo.distributed import (
    DEFAULT_TIMEOUT_S, DistEnv, all_gather_objects, apply_fsdp2, build_mesh, fill_sharded, init_distributed,
    materialize, parameter_device,
)
from klppo.errors import UserError
from klppo.models.attention import choose_packed_attention, set_packed_attention
from klppo.models.load import ROLES, check_model_folder, empty_model_for, load_causal_lm, load_critic, load_reward_model
from klppo.models.lora import LoraSpec, attach_adapters, read_adapter_config, with_adapters
from klppo.models.sharded_load import ConvertedWeights, WeightReader, converts_on_load, full_tensors
from klppo.monitoring.memory import HEAP_TOP_PAD

PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}  # None: no mixed precision


def return_freed_memory() -> bool:
    """Make glibc return freed blocks of 1 MiB and more to the OS, past a reused slack of
    ``HEAP_TOP_PAD`` at its heap's top; True where it took effect.

    glibc keeps a freed block below its mmap threshold in its heap for reuse, and raises the
    threshold (up to 32 MiB) each time a large block is freed. A run's all-gather buffers,
    gradients and activations of a few MiB then stay resident after use: on CPU, 2 FSDP2 ranks
    of a 0.5B model peaked at 10.3 GB per rank this way, 5.7 GB with a fixed threshold
    (``benchmarks/memory.py``). A fixed threshold also stops the growth.

    A fixed threshold alone maps every block of 1 MiB and more afresh and unmaps it when freed,
    so each activation pays its page faults again on every forward: issue #33's CPU workload spent
    0.44-0.47 s in the update that way against 0.30 s without it. With a top pad, glibc grows its
    heap by ``HEAP_TOP_PAD`` more than it needs and trims back to that much, so the blocks of a
    step are carved from memory already resident (glibc maps a block only when its heap's top
    cannot hold it). The pad is the trade between the two: 256 MiB left issue #33's PPO step,
    whose actor graph waits through the critic's update (``update_forwards_first``), mapping 145
    MiB afresh every step (update_critic 178-183 ms against 134-136 with 512, which maps none);
    0.5B offline GRPO peaked at 9.80 GiB on one process and 5.88 per rank on 2 with 512 (9.81
    and 5.55 with 256, 9.75 and 5.35 without a pad). CPU runs are mostly small models (tests,
    CI, the demo), where the faults cost most: 512 MiB.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to set
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # mallopt parameters (malloc.h)
    return all(libc.mallopt(option, value) for option, value in (
        (m_mmap_threshold, 1 << 20), (m_trim_threshold, 1 << 20), (m_top_pad, HEAP_TOP_PAD)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---- the output folder ----


def check_run_dir(path: str | os.PathLike, key: str = "trainer.default_local_dir") -> None:
    """Refuse, before any model loads, an output folder the run could not write into.

    The folder may exist (a run to resume) or not (it is made later); what must hold is that it
    is not a file, that no part of its path is a file, and that the nearest existing folder
    accepts a new file (probed with a temporary file that is removed at once). Nothing is left
    on disk.
    """
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} = '{path}' is an existing file, not a folder; point {key} at a folder "
                        "(it is created if missing)")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key} = '{path}' lies below '{existing}', which is a file; point {key} at a folder "
                        "whose parents are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".klppo-write-check-", dir=existing)
    except OSError as exc:
        raise UserError(f"{key} = '{path}': cannot write into '{existing}' ({exc.strerror or exc}); point {key} "
                        "at a folder you can write to") from None
    os.close(fd)
    os.unlink(probe)


# ---- the world ----


def join_world(device: str, n_gpus_per_node: int, nnodes: int, fsdp_configs: Iterable[FSDPConfig],
               timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join torchrun's process group and check it against ``trainer.n_gpus_per_node x nnodes``.

    A single process gets a group of one when an ``fsdp_config`` asks for something only FSDP2
    does (mixed precision, offload, ...), so it shards too. ``timeout_s``: how long a
    collective waits for the other ranks (PPO: ``actor_rollout_ref.nccl_timeout``; SFT and
    reward-model training, which have no such key in verl, keep verl's PPO default of 600 s).
    """
    env = init_distributed(device, group_of_one=any(f != FSDPConfig() for f in fsdp_configs), timeout_s=timeout_s)
    check_world(n_gpus_per_node, nnodes, env.world_size)
    return env


def check_world(n_gpus_per_node: int, nnodes: int, world_size: int) -> None:
    if n_gpus_per_node * nnodes != world_size:
        raise UserError(
            f"trainer.n_gpus_per_node x trainer.nnodes = {n_gpus_per_node} x {nnodes} = {n_gpus_per_node * nnodes}, "
            f"but this run has {world_size} process(es); launch with torchrun --nnodes {nnodes} --nproc_per_node "
            f"{n_gpus_per_node}, or set the two keys to the world you launch"
        )


class Sharder:
    """FSDP2 over the ranks when the run has a process group; models as they are otherwise.

    Device meshes are built once per ``fsdp_size`` and shared by the models of the run.
    """

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.meshes: dict[int, object] = {}

    def shard(self, model: torch.nn.Module, fsdp: FSDPConfig, *, keep_root_gathered: bool = False,
              replicate_frozen_root: bool = False) -> torch.nn.Module:
        if not self.env.is_distributed:
            return model
        if fsdp.fsdp_size not in self.meshes:
            try:
                self.meshes[fsdp.fsdp_size] = build_mesh(self.env.world_size, fsdp.fsdp_size, self.env.device.type)
            except ValueError as exc:
                raise UserError(f"fsdp_config.fsdp_size: {exc}") from None
        return apply_fsdp2(model, self.meshes[fsdp.fsdp_size], param_dtype=PARAM_DTYPES[fsdp.dtype],
                           reshard_after_forward=fsdp.reshard_after_forward, cpu_offload=fsdp.offload_policy,
                           keep_root_gathered=keep_root_gathered, replicate_frozen_root=replicate_frozen_root)


# ---- models ----

_LOADERS = {"causal_lm": load_causal_lm, "critic": load_critic, "reward_model": load_reward_model}


def lora_spec(model_cfg: LoraKeys, prefix: str) -> LoraSpec | None:
    """The LoRA adapters a config section asks for (``<prefix>.lora_rank`` etc., verl's keys), or None
    for full fine-tuning. A ``lora_adapter_path`` turns LoRA on by itself, as in verl; its own
    config then decides rank, alpha and target modules."""
    if not lora_enabled(model_cfg):
        return None

    def as_modules(value):
        return tuple(value) if isinstance(value, list) else value

    return read_adapter_config(LoraSpec(
        key=prefix, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
        target_modules=as_modules(model_cfg.target_modules), exclude_modules=as_modules(model_cfg.exclude_modules),
        adapter_path=model_cfg.lora_adapter_path))


def load_model(role: str, path: str, *, key: str, env: DistEnv, sharder: Sharder, fsdp: FSDPConfig, seed: int = 0,
               gradient_checkpointing: bool = False, packed: bool = False, attention: str | None = None,
               keep_root_gathered: bool = False, lora: LoraSpec | None = None) -> torch.nn.Module:
    """The actor, reference, critic or reward model (``role``: causal_lm | critic | reward_model) of
    folder ``path``, on this rank's device, sharded when the run has a process group.

    One process loads with ``from_pretrained``. Ranks build the model with its parameters on the
    meta device, shard it, and fill their shards from rank 0's reading of the folder one tensor at
    a time (``klppo.models.sharded_load``): no rank ever holds the whole model in fp32, and the
    weights are those ``from_pretrained`` gives. ``attention``: the run's attention for packed rows
    (``klppo.models.attention.choose_packed_attention``, chosen once for all of its models); None
    with ``packed``: this one model's own choice (a run of one model).

    ``lora``: LoRA adapters (``klppo.models.lora``) go into the backbone before sharding, so that
    FSDP2 shards them with the frozen weights of their blocks; only the adapters (and a critic's
    or reward model's new head) train. Their starting values come from ``seed`` (or a saved
    adapter), the same on one process and on any number of ranks.
    """
    dtype = PARAM_DTYPES[fsdp.dtype]
    train_head = role != "causal_lm"
    if attention is None and packed:  # one process computes in fp32: nothing casts it
        attention = choose_packed_attention(env.device.type, [dtype if env.is_distributed else None])
    if not env.is_distributed:
        kwargs = {"seed": seed} if role != "causal_lm" else {}
        model = _LOADERS[role](path, key=key, device=env.device, gradient_checkpointing=gradient_checkpointing,
                               **kwargs)
        if lora is not None:
            attach_adapters(model, lora, seed=seed, train_head=train_head)
        if attention is not None:
            set_packed_attention(model, attention)
        return model
    model = empty_model_for(role, path, key=key, gradient_checkpointing=gradient_checkpointing)
    if attention is not None:
        set_packed_attention(model, attention)
    # Before sharding (new heads are initialised on plain tensors), and on every rank, so a bad
    # folder fails everywhere at once (reading the names is a header read; tensors are read later).
    tensor_of = full_tensors(model, weight_reader(role, path, key, model, env), new_heads=ROLES[role][2], seed=seed)
    if lora is not None:
        tensor_of = with_adapters(model, lora, tensor_of, seed=seed, train_head=train_head)
    model = sharder.shard(model, fsdp, keep_root_gathered=keep_root_gathered, replicate_frozen_root=lora is not None)
    materialize(model, parameter_device(env.device, fsdp.offload_policy))
    fill_sharded(model, tensor_of if env.rank == 0 else None)
    return model


def weight_reader(role: str, path: str, key: str, model: torch.nn.Module, env: DistEnv
                  ) -> WeightReader | ConvertedWeights:
    """What the ranks fill ``model``'s shards from: the folder's tensors one at a time, or where
    transformers converts them as it loads them (MoE experts, ``converts_on_load``) rank 0's
    converted copy, whose names every rank gets (one collective, on every rank alike)."""
    folder = check_model_folder(path, key)
    reader = WeightReader(folder, key)
    if not converts_on_load(model, reader):
        return reader
    converted = ConvertedWeights.load(ROLES[role][0], folder, key, model.config) if env.rank == 0 else None
    names = all_gather_objects(sorted(converted.names) if converted is not None else None)[0]
    return converted if converted is not None else ConvertedWeights(folder, key, names)


# ---- optimiser and schedule ----


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], name: str = "AdamW",
    impl: str = TORCH_OPTIM, override: Optional[dict] = None,
) -> torch.optim.Optimizer:
    """The optimiser ``name`` of module ``impl`` (AdamW by default) over the trainable parameters, built as
    verl builds it (``lr``, ``weight_decay``, ``betas`` for Adam-like names, then ``override``'s
    arguments over them); biases and norm weights get no weight decay.

    torch's AdamW and Adam are fused wherever the parameters all live on one CUDA device or on CPU
    (sharded or not: FSDP2's offload_policy keeps them, and their gradients, on CPU): one kernel
    per step on CUDA, one vectorised pass per tensor on CPU, and either way ``optimizer_step``
    skips a non-finite step without a host sync. On CPU it stepped issue #33's 5.0M-parameter
    model 3x faster than the default per-tensor foreach path (3.8 vs 11.5 ms, one thread;
    transformers' Trainer, so TRL, defaults to it too); its floats differ from foreach's in the
    last bits.
    """
    decay, no_decay = [], []
    for param_name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    kwargs = {"lr": lr, "weight_decay": weight_decay, **({"betas": tuple(betas)} if takes_betas(name) else {}),
              **(override or {})}
    groups = [{"params": decay, "weight_decay": kwargs.pop("weight_decay")}, {"params": no_decay, "weight_decay": 0.0}]
    cls = optimizer_class(impl, name)
    devices = {p.device.type for p in decay + no_decay}
    if cls in (torch.optim.AdamW, torch.optim.Adam) and "fused" not in kwargs:
        kwargs["fused"] = True if len(devices) == 1 and devices <= {"cuda", "cpu"} else None
    return cls(groups, **kwargs)


def warmup_steps(total_steps: int, lr_warmup_steps: int, lr_warmup_steps_ratio: float) -> int:
    """verl's rule: an explicit step count wins; -1 means a ratio of the total."""
    if lr_warmup_steps >= 0:
        return lr_warmup_steps
    return int(lr_warmup_steps_ratio * total_steps)


def lr_multiplier(step: int, *, warmup: int, total_steps: int, style: str, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then constant or cosine decay to ``min_lr_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    lr_warmup_steps: int,
    lr_warmup_steps_ratio: float,
    warmup_style: str,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A schedule stepped once per training step."""
    warmup = warmup_steps(total_steps, lr_warmup_steps, lr_warmup_steps_ratio)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup=warmup, total_steps=total_steps, style=warmup_style, min_lr_ratio=min_lr_ratio
        ),
    )


def build_optimizer_and_scheduler(model: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """The optimiser and its schedule from an ``optim`` config section (actor, critic, SFT or RM)."""
    optimizer = build_optimizer(model, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas,
                                name=optim.optimizer, impl=optim.optimizer_impl, override=optim.override_optimizer_config)
    scheduler = build_lr_scheduler(
        optimizer,
        total_steps=total_steps,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        warmup_style=optim.warmup_style,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return optimizer, scheduler
