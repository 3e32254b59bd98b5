"""The engine a LoRA run builds, fed its trained adapters: ``python vllm_lora_worker.py RUN_DIR OUT.json``.

The run's own config (``RUN_DIR/config.yaml``) decides the engine (``compile_ppo``: its dtype
among the rest); its exported adapter (``RUN_DIR/actor_adapter``) goes on the base model in fp32,
the actor's master weights. Written out: the engine's dtype, and on tokens the engine samples
the largest gap between its log-probs and the actor's, beside the mean change the training made
to the actor's log-probs of the same tokens (the actor's against its base model's).
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from klppo.config import load_ppo_config
from klppo.data.rl_dataset import load_rl_dataset
from klppo.models.forward import response_logprobs
from klppo.models.load import load_tokenizer
from klppo.models.lora import LoraSpec, attach_adapters, read_adapter_config
from klppo.rollout.hf import SamplingParams
from klppo.rollout.vllm import VLLMEngine, request_seed
from klppo.run.settings import compile_ppo
from klppo.trainer.responses import engine_weights

CPU = torch.device("cpu")


def log_probs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_length)[0]


def main(run_dir: str, out: str) -> None:
    cfg = load_ppo_config(str(Path(run_dir) / "config.yaml"), [])
    settings = compile_ppo(cfg, 1).engine
    path = cfg.actor_rollout_ref.model.path
    tokenizer = load_tokenizer(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    spec = read_adapter_config(LoraSpec("actor_rollout_ref.model", rank=0, alpha=0, target_modules=None,
                                        adapter_path=str(Path(run_dir) / "actor_adapter")))
    attach_adapters(actor, spec, seed=0, train_head=False)  # the trained adapters' values, on the fp32 base
    engine = VLLMEngine(path, actor.config, settings, CPU, False, 8 << 30, generation_config=actor.generation_config)
    engine.load_weights(engine_weights(actor, settings.dtype, CPU, engine.parameter_names))
    records = load_rl_dataset(cfg.data.train_files, tokenizer, max_prompt_length=64, log=lambda *a: None)[:16]
    seeds = [request_seed(5, 1, r.index, k) for r in records for k in range(2)]
    batch = engine.generate(records, SamplingParams(n=2, max_new_tokens=12), seeds, tokenizer)
    engine.shutdown()
    mask, trained = batch.response_mask, log_probs(actor, batch)
    gap = (trained - batch.rollout_log_probs).abs()[mask].max()
    change = (trained - log_probs(base, batch)).abs()[mask].mean()
    Path(out).write_text(json.dumps({"dtype": str(settings.dtype), "gap": float(gap), "change": float(change)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
