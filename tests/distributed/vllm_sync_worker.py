"""A vLLM PPO run, then the check that its engine generates as the actor now computes:
``[torchrun ...] vllm_sync_worker.py OUT_DIR key=value ...``. After the run's updates each rank
syncs the engine, samples greedily for the same prompts through the engine and through HF
generate on the actor (its gathered copy on ranks), and writes ``rank_R.json``."""

import json
import sys
from pathlib import Path

import torch

from klppo.config import load_ppo_config
from klppo.distributed import run_on_ranks
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.run.build import build_ppo, start_processes
from klppo.commands.main_ppo import engine_stopped_at_the_end
from klppo.trainer.ppo_trainer import PPOTrainer
from klppo.trainer.responses import engine_responses, generation_model, sync_engine_weights


def check(cfg, env, out: Path) -> None:
    parts = build_ppo(cfg, log=lambda *a: None, env=env)
    with engine_stopped_at_the_end(parts):
        metrics = PPOTrainer(parts, print_fn=lambda *a: None).fit()
        records = parts.train_records[:8]
        greedy = SamplingParams(n=1, max_new_tokens=parts.settings.response_length, do_sample=False)
        sync_engine_weights(parts)
        ours = engine_responses(parts, records, greedy, step=0)
        with generation_model(parts) as (model, sharded):
            theirs = hf_rollout(model, records, parts.tokenizer, greedy, synced_gpus=sharded, device=env.device)
        steps = [m for m in metrics if m["step"] > 0]
        result = {"steps": len(steps), "ids": torch.equal(ours.response_ids, theirs.response_ids),
                  "masks": torch.equal(ours.response_mask, theirs.response_mask),
                  "rows_equal": int((ours.response_ids == theirs.response_ids).all(-1).sum()),
                  "probs_diff_max": [m["training/rollout_probs_diff_max"] for m in steps]}
        (out / f"rank_{env.rank}.json").write_text(json.dumps(result))


def main(out: str, *overrides: str) -> None:
    cfg = load_ppo_config(None, list(overrides))
    env = start_processes(cfg)
    run_on_ranks(env, lambda log: check(cfg, env, Path(out)))


if __name__ == "__main__":
    main(*sys.argv[1:])
