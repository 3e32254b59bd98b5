"""The only user of ``torch.distributed``: process group, collectives, device mesh, FSDP2, DCP."""

from klppo.distributed.checkpoint import (
    load_model_training_state, load_sharded, load_training_state, model_training_state, save_sharded, training_state,
)
from klppo.distributed.dcp_reader import ShardedContents, read_sharded_contents, requested_keys
from klppo.distributed.env import (
    DEFAULT_TIMEOUT_S,
    SINGLE_PROCESS,
    DistEnv,
    abandon,
    all_gather_groups,
    all_gather_objects,
    all_gather_padded,
    all_gather_rows,
    all_reduce_max_int,
    all_reduce_sum,
    barrier,
    close,
    init_distributed,
    launched_world_size,
    max_over_ranks,
    mean_over_ranks,
    my_rows,
    on_rank_zero,
    reduce_counts,
    reduce_stats,
    resolve_device,
    run_on_ranks,
    same_on_every_rank,
    shard_range,
)
from klppo.distributed.fsdp import (
    apply_fsdp2, build_mesh, fill_sharded, full_state_dict, gather_full_model, inference_copy, inference_copy_bytes,
    is_sharded, load_in_place, materialize, parameter_device, plain_class, plain_copy, reshard, tied_aliases,
    whole_parameters, whole_tensor_groups,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "SINGLE_PROCESS", "DistEnv", "ShardedContents", "abandon", "all_gather_groups", "all_gather_objects", "all_gather_padded",
    "all_gather_rows", "all_reduce_max_int", "all_reduce_sum", "apply_fsdp2", "fill_sharded", "materialize", "barrier", "build_mesh", "close",
    "full_state_dict", "gather_full_model", "inference_copy", "inference_copy_bytes", "init_distributed", "launched_world_size", "max_over_ranks", "mean_over_ranks", "my_rows", "on_rank_zero", "is_sharded", "load_in_place", "load_sharded", "parameter_device",
    "load_model_training_state", "load_training_state", "model_training_state", "read_sharded_contents", "reduce_counts", "reduce_stats", "requested_keys", "resolve_device", "run_on_ranks", "same_on_every_rank",
    "save_sharded", "shard_range", "training_state", "plain_class", "plain_copy", "reshard", "tied_aliases", "whole_parameters", "whole_tensor_groups",
]
