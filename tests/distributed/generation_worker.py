"""One rank of the generation test: sample with the sharded actor and with its gathered copy, counting
the collectives each decoding runs (torch profiler), and (rank 0) save both to ``<out>/generation.pt``.

argv: model folder, task folder, out folder.
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from klppo.config.schema import FSDPConfig
from klppo.data.rl_dataset import load_rl_dataset
from klppo.distributed import all_gather_objects, close, inference_copy, init_distributed, shard_range
from klppo.models.load import load_tokenizer
from klppo.monitoring.overlap import is_communication
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.run.setup import Sharder, load_model


def sample(model, records, tokenizer, sharded: bool):
    torch.manual_seed(11)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch = hf_rollout(model, records, tokenizer, SamplingParams(n=2, max_new_tokens=12), synced_gpus=sharded)
    collectives = sum(e.count for e in prof.key_averages() if is_communication(e.key))
    return batch.response_ids.tolist(), collectives


if __name__ == "__main__":
    model_dir, task, out = (Path(a) for a in sys.argv[1:4])
    env = init_distributed("cpu")
    tokenizer = load_tokenizer(str(model_dir))
    records = load_rl_dataset(task / "train.parquet", tokenizer, max_prompt_length=64, log=lambda *_: None)[:4]
    mine = records[shard_range(len(records), env)]
    actor = load_model("causal_lm", str(model_dir), key="k", env=env, sharder=Sharder(env), fsdp=FSDPConfig())
    sharded = sample(actor, mine, tokenizer, sharded=True)
    copy = inference_copy(actor, None, env.device)
    gathered = sample(copy, mine, tokenizer, sharded=False)
    results = all_gather_objects({"sharded": sharded, "gathered": gathered})
    if env.rank == 0:
        torch.save(results, out / "generation.pt")
    close(env)
