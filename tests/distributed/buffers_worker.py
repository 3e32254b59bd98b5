"""One rank of the persistent-buffer test: load a folder on ranks through klppo.run.setup.load_model,
then (rank 0) save what the sharded model, its generation copy and its export hold.

argv: model folder, tokenizer folder, out folder. Writes ``<out>/buffers.pt`` ({"sharded": whole
state, "copy": the generation copy's state}) and the exported folder ``<out>/exported``.
"""

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from klppo.checkpoint.export import export_hf
from klppo.config.schema import FSDPConfig
from klppo.distributed import close, full_state_dict, inference_copy, init_distributed
from klppo.run.setup import Sharder, load_model

if __name__ == "__main__":
    model_dir, tokenizer_dir, out = (Path(a) for a in sys.argv[1:4])
    env = init_distributed("cpu")
    model = load_model("causal_lm", str(model_dir), key="k", env=env, sharder=Sharder(env), fsdp=FSDPConfig())
    sharded = full_state_dict(model)
    copy = inference_copy(model, None, env.device)
    export_hf(model, AutoTokenizer.from_pretrained(tokenizer_dir), out / "exported", env)
    if env.rank == 0:
        torch.save({"sharded": {k: v.clone() for k, v in sharded.items()}, "copy": copy.state_dict()},
                   out / "buffers.pt")
    close(env)
