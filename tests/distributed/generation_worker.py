"""One rank of the generation test: sample with the sharded actor and with its gathered copy, counting
the collectives each decoding runs (torch profiler); then move every shard of the actor and write its
weights into the copy in place (``refresh_generation_copy``); (rank 0) save all to ``<out>/generation.pt``.

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
from klppo.trainer.responses import refresh_generation_copy


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
    addresses, before = [p.data_ptr() for p in copy.parameters()], [p.clone() for p in copy.parameters()]
    with torch.no_grad():  # as an optimiser step moves every shard
        for param in actor.parameters():
            param.to_local().add_(0.01)
    refresh_generation_copy(copy, actor, torch.float32, env.device)
    fresh = inference_copy(actor, None, env.device).state_dict()
    refreshed = {"same_addresses": addresses == [p.data_ptr() for p in copy.parameters()],
                 "equal": all(torch.equal(t, fresh[name]) for name, t in copy.state_dict().items()),
                 "moved": all(not torch.equal(p, old) for p, old in zip(copy.parameters(), before))}
    results = all_gather_objects({"sharded": sharded, "gathered": gathered, "refreshed": refreshed})
    if env.rank == 0:
        torch.save(results, out / "generation.pt")
    close(env)
