"""The only user of ``torch.distributed``: process group, collectives, device mesh, FSDP2."""

from klppo.dist.env import (
    DistEnv,
    all_reduce_max_int,
    all_reduce_sum,
    barrier,
    close,
    init_distributed,
    reduce_counts,
    reduce_stats,
    shard_range,
)
from klppo.dist.fsdp import apply_fsdp2, build_mesh, full_state_dict

__all__ = [
    "DistEnv", "all_reduce_max_int", "all_reduce_sum", "apply_fsdp2", "barrier", "build_mesh", "close", "full_state_dict",
    "init_distributed", "reduce_counts", "reduce_stats", "shard_range",
]
