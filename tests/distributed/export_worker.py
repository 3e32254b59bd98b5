"""One rank of the export test: an FSDP2-sharded model's logits, and its export through ``export_hf``.

Writes ``<dir>/sharded_logits.pt`` (rank 0) and the exported folder ``<dir>/exported``.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.checkpoint.export import export_hf
from klppo.distributed import apply_fsdp2, build_mesh, close, init_distributed

if __name__ == "__main__":
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    env = init_distributed("cpu")
    model = apply_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir), build_mesh(env.world_size))
    with torch.no_grad():  # move the weights off their start, so the export is not the input folder
        for param in model.parameters():
            param.mul_(1.5)
        logits = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits
    export_hf(model, AutoTokenizer.from_pretrained(model_dir), out / "exported", env)
    if env.rank == 0:
        torch.save(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, out / "sharded_logits.pt")
    close(env)
