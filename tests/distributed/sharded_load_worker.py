"""One rank of the sharded-loading test: load folders through klppo.run.setup.load_model on ranks,
then gather each model whole and (rank 0) save its state as ``<out>/<name>.pt``.

argv: out folder, then name=role:path pairs.
"""

import sys
from pathlib import Path

import torch

from klppo.config.schema import FSDPConfig
from klppo.distributed import close, full_state_dict, init_distributed
from klppo.run.setup import Sharder, load_model

if __name__ == "__main__":
    out, specs = Path(sys.argv[1]), sys.argv[2:]
    env = init_distributed("cpu", group_of_one=True)
    sharder = Sharder(env)
    for spec in specs:
        name, rest = spec.split("=", 1)
        role, path = rest.split(":", 1)
        model = load_model(role, path, key="test", env=env, sharder=sharder, fsdp=FSDPConfig(), seed=3)
        state = full_state_dict(model)
        if env.rank == 0:
            torch.save({k: v.clone() for k, v in state.items()}, out / f"{name}.pt")
    close(env)
