"""One rank of the 2-D mesh test: ``build_mesh(4, fsdp_size=2)`` is HSDP (2 replicas x 2 shards)."""

import sys
from pathlib import Path

from klppo.distributed import all_reduce_max_int, build_mesh, close, init_distributed

if __name__ == "__main__":
    env = init_distributed("cpu")
    mesh = build_mesh(env.world_size, fsdp_size=2)
    largest = all_reduce_max_int(env.rank + 10)
    if env.rank == 0:
        Path(sys.argv[1]).write_text(f"{mesh.mesh_dim_names} {tuple(mesh.shape)} {largest}")
    close(env)
