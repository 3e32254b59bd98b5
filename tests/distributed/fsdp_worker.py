"""One rank of the FSDP2 equivalence test; run by ``torchrun`` from test_fsdp_update_equivalence.py.

Reads ``<dir>/inputs.pt`` (models, global batch, cases), runs each case's update on an FSDP2
copy of the model over this rank's shard of the batch, and on rank 0 writes
``<dir>/results.pt``: {case name: (metrics as floats, full parameters)}.
"""

import copy
import sys
from pathlib import Path

import torch

from klppo.distributed import apply_fsdp2, build_mesh, close, full_state_dict, init_distributed, shard_range
from klppo.trainer.update import update_actor, update_critic


def _run_case(case: dict, models: dict, batch, env, mesh):
    model = apply_fsdp2(copy.deepcopy(models[case["model"]]), mesh, param_dtype=case.get("param_dtype"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    update = update_actor if case["model"] == "actor" else update_critic
    shard = batch.select(torch.arange(len(batch))[shard_range(len(batch), env)])
    metrics = update(model, optimizer, shard, case["settings"])  # collectives inside: global counts and stats
    params = full_state_dict(model)
    return {k: float(v) for k, v in metrics.items()}, params


def main(folder: Path) -> None:
    env = init_distributed("cpu")
    torch.manual_seed(0)
    inputs = torch.load(folder / "inputs.pt", weights_only=False)
    mesh = build_mesh(env.world_size)
    results = {name: _run_case(case, inputs["models"], inputs["batch"], env, mesh) for name, case in inputs["cases"].items()}
    if env.rank == 0:
        torch.save(results, folder / "results.pt")
    close(env)
    close(env)  # idempotent


if __name__ == "__main__":
    main(Path(sys.argv[1]))
