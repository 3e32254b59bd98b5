"""One rank of the FSDP2 test of the fused head; run by test_fused_head_fsdp.py (plain python for a
group of one, ``torchrun`` for more).

Reads ``<dir>/inputs.pt`` (a model, a batch, the cases), runs each case on an FSDP2 copy of the
model (every rank the same batch) and on rank 0 writes ``<dir>/results.pt``:
{case name: (log-probs, entropies, {parameter name: full gradient})}.
"""

import copy
import sys
from pathlib import Path

import torch

from klppo.distributed import apply_fsdp2, build_mesh, close, init_distributed
from klppo.models.forward import HeadSettings, response_logprobs


def _run_case(model, batch, case: dict, mesh):
    sharded = apply_fsdp2(copy.deepcopy(model), mesh, param_dtype=case.get("param_dtype"))
    ids, mask, width = batch
    lp, ent = response_logprobs(sharded, ids, mask, width, temperature=0.7, with_entropy=True, packed=case["packed"],
                                head=HeadSettings(fused=case["fused"], chunk_logits=40))
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    ((lp * weights).sum() + 0.3 * ent.sum()).backward()
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    return lp.detach(), ent.detach(), grads


def main(folder: Path) -> None:
    env = init_distributed("cpu", group_of_one=True)
    inputs = torch.load(folder / "inputs.pt", weights_only=False)
    mesh = build_mesh(env.world_size)
    results = {name: _run_case(inputs["model"], inputs["batch"], case, mesh) for name, case in inputs["cases"].items()}
    if env.rank == 0:
        torch.save(results, folder / "results.pt")
    close(env)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
