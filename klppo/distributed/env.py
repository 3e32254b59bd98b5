"""The process group: who this rank is, on which device, and the few collectives the trainer needs.

Everything comes from the environment ``torchrun`` sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). With WORLD_SIZE unset or 1 no process group is created (unless a
group of one is asked for, which FSDP2 needs) and every collective here is the identity, so a
single process runs the same code.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from klppo.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int  # global rank, 0 .. world_size - 1
    world_size: int  # number of processes in the run
    local_rank: int  # rank on this node; picks the GPU (``local_device_index``)
    device: torch.device  # where this rank's models and batches live
    is_distributed: bool  # True when a process group was joined (world_size > 1, or a group of one)


SINGLE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_distributed=False)


# The process group of a CUDA run: NCCL for CUDA tensors, gloo for CPU ones. CPU tensors meet
# collectives when FSDP2's offload_policy keeps gradients on CPU (clip_grad_norm_ and the
# grad-norm DTensor's full_tensor() all-reduce them) and in object collectives; an NCCL-only
# group fails there with "No backend type associated with device type cpu". verl's
# fsdp_workers init the same pair.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"
DEFAULT_TIMEOUT_S = 600  # verl's actor_rollout_ref.nccl_timeout default


def local_device_index(local_rank: int, visible: int, local_world_size: int | None = None) -> int:
    """The CUDA device this rank uses among the ``visible`` ones.

    torchrun's LOCAL_RANK indexes the node's GPUs when every process sees all of them; a
    launcher that gives each process one GPU (CUDA_VISIBLE_DEVICES per process, SLURM's
    --gpus-per-task) leaves LOCAL_RANK at 0..k-1 with one visible device, index 0. More
    processes on the node (LOCAL_RANK, or torchrun's LOCAL_WORLD_SIZE) than the GPUs each sees
    would put two ranks on one GPU, to run out of its memory or stall in NCCL: refused.
    """
    if visible < 1:
        raise UserError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    if visible == 1:
        return 0
    processes = max(local_rank + 1, local_world_size or 0)
    if processes > visible:
        raise UserError(
            f"LOCAL_RANK={local_rank} with {processes} processes on this node, but this process sees {visible} CUDA "
            f"devices, so two ranks would share a GPU; launch at most {visible} processes per node (torchrun "
            f"--nproc_per_node {visible} and trainer.n_gpus_per_node={visible}), or give each process its own GPU "
            "(CUDA_VISIBLE_DEVICES)")
    return local_rank


def resolve_device(device: str, local_rank: int = 0, local_world_size: int | None = None,
                   key: str = "trainer.device") -> torch.device:
    """The device ``auto`` / ``cpu`` / ``cuda`` names for this local rank (``key``: the setting, for errors)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{key}=cuda but no CUDA device is visible; use {key}=cpu or auto")
        return torch.device("cuda", local_device_index(local_rank, torch.cuda.device_count(), local_world_size))
    if device != "cpu":
        raise UserError(f"{key} must be auto, cpu or cuda, not '{device}'")
    return torch.device("cpu")


def launched_world_size() -> int:
    """The processes torchrun started for this run (``WORLD_SIZE``; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto", *, group_of_one: bool = False,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """This process's ``DistEnv``; joins torchrun's process group (gloo on CPU; NCCL for CUDA
    tensors plus gloo for CPU ones on CUDA, ``CUDA_BACKEND``).

    A single process gets no process group, unless ``group_of_one`` asks for a group of one
    rank (FSDP2 needs one, e.g. for bf16 mixed precision or CPU offload on one device).
    ``timeout_s``: how long any collective of the group may wait for the other ranks before
    the run fails (``actor_rollout_ref.nccl_timeout``).
    """
    world_size = launched_world_size()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None  # torchrun's
    dev = resolve_device(device, local_rank, local_world_size)
    if world_size == 1 and not group_of_one:
        return DistEnv(rank=0, world_size=1, local_rank=0, device=dev, is_distributed=False)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        backend = CUDA_BACKEND if dev.type == "cuda" else "gloo"
        common = dict(backend=backend, timeout=timedelta(seconds=timeout_s),
                      device_id=dev if dev.type == "cuda" else None)
        if world_size == 1:  # no rendezvous needed: an in-memory store
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **common)
        else:
            dist.init_process_group(rank=rank, world_size=world_size, **common)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, is_distributed=True)


def run_on_ranks(env: DistEnv, work: Callable[[Callable], T], print_fn: Callable = print) -> T:
    """``work(print_fn)`` on this rank (only rank 0 prints), then leave the process group.

    In step with the other ranks (``close``) after a success, and after an error every rank
    raised at the same point (``same_on_every_rank``): a rank that closed its connections at once
    could cut off a peer still reading that rank's part of the collective that agreed the error.
    At once after any other failure (``abandon``): the other ranks may never arrive, and torchrun
    stops them when it sees this rank fail, so no one hangs.
    """
    try:
        result = work(on_rank_zero(print_fn, env))
    except UserError as error:
        close(env) if error.raised_on_every_rank else abandon(env)
        raise
    except BaseException:
        abandon(env)
        raise
    close(env)
    return result


def same_on_every_rank(work: Callable[[], T]) -> T:
    """``work()``; a ``UserError`` it raises on any rank is raised on every rank (one collective).

    Some checks see only this rank's share: the user's reward function scores this rank's rows,
    the resume check reads this rank's rank_R.pt. One rank alone would refuse, and the others
    would go on into the next collective until the launcher killed them, their logs showing a
    lost connection instead of the user's error. Agreeing first stops every rank with the same
    error (exit status 2), as one process stops, and marks it ``raised_on_every_rank``.
    """
    try:
        result, error = work(), None
    except UserError as exc:
        result, error = None, exc
    messages = [m for m in all_gather_objects(None if error is None else str(error)) if m is not None]
    if not messages:
        return result
    agreed = error if error is not None else UserError(messages[0])
    agreed.raised_on_every_rank = True
    raise agreed


def on_rank_zero(print_fn: Callable, env: DistEnv) -> Callable:
    """``print_fn`` on rank 0, a function that prints nothing elsewhere (rank 0 says the same)."""
    return print_fn if env.rank == 0 else _print_nothing


def _print_nothing(*args, **kwargs) -> None:
    pass


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def abandon(env: DistEnv) -> None:
    """After an error: leave the process group without waiting for the other ranks.

    torchrun sees this rank fail and stops the others; a barrier here would hang instead.
    """
    if env.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over all ranks (a new tensor; ``t`` itself is left alone)."""
    if not _active():
        return t.detach().clone()
    out = t.detach().to(_comm_device()).clone()  # NCCL reduces CUDA tensors only
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def all_reduce_max_int(n: int, device: torch.device | None = None) -> int:
    """The largest ``n`` over all ranks (e.g. the number of micro-batches every rank must run)."""
    if not _active():
        return int(n)
    t = torch.tensor([int(n)], dtype=torch.int64, device=device or _comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())  # host-device sync


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value's largest over all ranks (one all-reduce, keys sorted; every rank has the same keys)."""
    keys = sorted(values)
    if not keys or not _active():
        return dict(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value's mean over all ranks, the same on every rank (one all-reduce, keys sorted; every rank
    has the same keys). For the numbers a rank decides by (guards, the KL controller): a value
    each rank computes for itself need not be bitwise the same everywhere (sampling on each GPU,
    kernels of other GPU models), and ranks that decide differently wait in different
    collectives. A NaN or inf on any rank makes the mean non-finite; equal values stay equal
    (exactly, for a power-of-two world)."""
    keys = sorted(values)
    if not keys or not _active():
        return dict(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, (t / dist.get_world_size()).tolist()))


def reduce_counts(tokens: torch.Tensor, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global token and sequence counts of a mini-batch from each rank's own (one all-reduce)."""
    both = all_reduce_sum(torch.stack([tokens, seqs]).to(torch.int64))
    return both[0], both[1]


def reduce_stats(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each additive per-rank metric share summed over ranks (one all-reduce, keys sorted)."""
    keys = sorted(stats)
    if not keys or not _active():
        return dict(stats)
    summed = all_reduce_sum(torch.stack([stats[k].detach().float().reshape(()) for k in keys]))
    return dict(zip(keys, summed.unbind()))


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on every rank) stacked along dim 0 in rank order."""
    if not _active():
        return t
    dtype = t.dtype
    local = t.to(_comm_device(), torch.uint8 if dtype == torch.bool else dtype).contiguous()  # gloo has no bool
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device, dtype)


def my_rows(gathered: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an ``all_gather_rows`` result (equal shares, rank order); all of it in one process."""
    if not _active():
        return gathered
    rows = gathered.shape[0] // dist.get_world_size()
    return gathered[dist.get_rank() * rows : (dist.get_rank() + 1) * rows]


def all_gather_padded(t: torch.Tensor, pad_value: int | float) -> torch.Tensor:
    """(b, w_r) tensors of equal ``b`` but their own widths: right-padded to the widest, then stacked."""
    if not _active():
        return t
    width = all_reduce_max_int(t.shape[1])
    padded = torch.nn.functional.pad(t.to(torch.int64) if t.dtype == torch.bool else t, (0, width - t.shape[1]),
                                     value=pad_value)
    return all_gather_rows(padded).to(t.dtype)


def all_gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` in one process)."""
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shard_range(n_items: int, env: DistEnv, group_size: int = 1) -> slice:
    """This rank's contiguous, equal share of ``n_items`` (rank r gets block r); with ``group_size``
    consecutive ranks sharing one block (a tensor-parallel engine's group), block r // group_size."""
    groups = env.world_size // group_size
    if n_items % groups:
        raise ValueError(
            f"{n_items} items do not split evenly over {groups} {'ranks' if group_size == 1 else 'engines'}; make the batch size "
            f"(data.train_batch_size * rollout.n) a multiple of the number of ranks"
        )
    size = n_items // groups
    block = env.rank // group_size
    return slice(block * size, (block + 1) * size)


def all_gather_groups(t: torch.Tensor, pad_value: int | float, group_size: int) -> torch.Tensor:
    """``all_gather_padded`` where each group of ``group_size`` consecutive ranks holds the same rows:
    one copy per group, in group order."""
    gathered = all_gather_padded(t, pad_value)
    if not _active() or group_size == 1:
        return gathered
    per_rank = gathered.reshape(dist.get_world_size(), t.shape[0], *gathered.shape[1:])
    return per_rank[::group_size].reshape(-1, *gathered.shape[1:])


def consecutive_group(group_size: int):
    """This rank's group of ``group_size`` consecutive ranks (a tensor-parallel engine's), as a gloo
    process group for objects; None in one process or for groups of one. Collective: every rank
    builds every group, in the same order."""
    if not _active() or group_size == 1:
        return None
    rank, mine = dist.get_rank(), None
    for first in range(0, dist.get_world_size(), group_size):
        group = dist.new_group(list(range(first, first + group_size)), backend="gloo")
        if first <= rank < first + group_size:
            mine = group
    return mine


def computed_by_first_rank(group) -> Callable[[Callable[[], T]], T]:
    """``share(compute)``: the group's first rank alone runs ``compute()``, and every member gets what it
    returned (picklable); without a group, ``compute()`` itself. Where ``compute`` raises, every member
    raises: the first rank its own error, the others one that names it."""
    if group is None:
        return lambda compute: compute()
    first = dist.get_global_rank(group, 0)

    def share(compute: Callable[[], T]) -> T:
        failure, box = None, [None]
        if dist.get_rank() == first:
            try:
                box = [(True, compute())]
            except Exception as error:  # noqa: BLE001 (the group must hear of it, or it waits forever)
                failure, box = error, [(False, f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(box, src=first, group=group)
        if failure is not None:
            raise failure
        done, value = box[0]
        if not done:
            raise RuntimeError(f"rank {first}, which computes this group's answers, failed: {value}")
        return value

    return share


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if _active():
        dist.barrier()


def close(env: DistEnv) -> None:
    """Free what the run left behind, wait for every rank, then leave the process group; safe to
    call twice or without one."""
    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    if env.is_distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    """The device klppo's own collectives run on: CUDA when the group has NCCL (faster, and
    ``CUDA_BACKEND`` reports itself as "cpu:gloo,cuda:nccl"), else CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
