"""One vLLM engine in one process (vLLM allows one per process), put through the checks that
``test_vllm_engine.py`` asserts on: ``python vllm_engine_worker.py MODEL_DIR TRAIN_PARQUET OUT.json``.

Every check compares the engine with the trainer's side of klppo on the same weights: HF
generate's greedy tokens, masks and EOS handling, and ``response_logprobs``' log-probs.
"""

import dataclasses
import json
import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data.rl_dataset import load_rl_dataset
from klppo.models.forward import response_logprobs
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.rollout.vllm import EngineSettings, VLLMEngine, request_seed

SETTINGS = EngineSettings(
    tensor_parallel_size=1, dtype=torch.float32, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
    max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=256, enforce_eager=None, enable_chunked_prefill=True,
    enable_prefix_caching=True, load_format="dummy", sleep_between_generations=True, calculate_log_probs=True,
    logprobs_mode="processed_logprobs", ignore_eos=False, seed=42, rows_per_generation=32)


def same_greedy(engine, model, records, tokenizer, length: int = 12) -> dict:
    params = SamplingParams(n=1, max_new_tokens=length, do_sample=False)
    ours = engine.generate(records, params, [0] * len(records), tokenizer)
    theirs = hf_rollout(model, records, tokenizer, params)
    return {"ids": torch.equal(ours.response_ids, theirs.response_ids),
            "masks": torch.equal(ours.response_mask, theirs.response_mask),
            "rows_equal": int((ours.response_ids == theirs.response_ids).all(-1).sum()),
            "cut_short": int((theirs.response_mask.sum(-1) < length).sum())}


def log_prob_gap(engine, model, records, tokenizer, temperature: float) -> float:
    """The largest |engine - trainer| log-prob of a sampled token."""
    params = SamplingParams(n=2, max_new_tokens=12, temperature=temperature)
    seeds = [request_seed(1, 1, r.index, k) for r in records for k in range(2)]
    batch = engine.generate(records, params, seeds, tokenizer)
    with torch.no_grad():
        trainer, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_length,
                                       temperature=temperature)
    return float(((trainer - batch.rollout_log_probs).abs() * batch.response_mask).max())


def process_state() -> dict:
    return {"torch": torch.get_rng_state().sum().item(), "numpy": float(np.random.get_state()[1].sum()),
            "python": random.getstate()[1][:4], "threads": torch.get_num_threads(),
            "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}


def class_state() -> dict:
    """Every module class of transformers' model modules imported so far: its bases and own attributes."""
    return {cls: (cls.__bases__, dict(vars(cls))) for module in list(sys.modules.values())
            if getattr(module, "__name__", "").startswith("transformers.models.")
            for cls in list(vars(module).values()) if isinstance(cls, type) and issubclass(cls, torch.nn.Module)}


def main(model_dir: str, train: str, out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = load_rl_dataset(train, tokenizer, max_prompt_length=64, log=lambda *a: None)[:16]
    results = {}

    os.environ["LOCAL_WORLD_SIZE"] = "3"
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    before, classes = process_state(), class_state()
    engine = VLLMEngine(model_dir, model.config, SETTINGS, torch.device("cpu"), False, 8 << 30,
                        generation_config=model.generation_config)
    results["state_after_build"] = process_state() == before
    results["classes_after_build"] = class_state() == classes
    results["restored_classes"] = [c.__name__ for c in engine.restored_classes]
    results["engine_classes"] = engine.llm.apply_model(
        lambda m: sorted({type(x).__name__ for x in m.modules() if type(x).__bases__[0] in engine.restored_classes}))[0]
    results["rng_draw"] = torch.rand(1).item()

    engine.load_weights(klppo_weights(model, engine))
    results["greedy"] = same_greedy(engine, model, records, tokenizer)
    results["gap_t1"] = log_prob_gap(engine, model, records, tokenizer, 1.0)
    results["gap_t07"] = log_prob_gap(engine, model, records, tokenizer, 0.7)

    # EOS: stand in a token the greedy responses emit early as the EOS, so responses end there.
    first = hf_rollout(model, records[:1], tokenizer, SamplingParams(n=1, max_new_tokens=4, do_sample=False))
    eos = int(first.response_ids[0, 2])
    stand_in = SimpleNamespace(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    results["eos"] = same_greedy(engine, model, records, stand_in)

    # The same seeds give the same samples, whether the requests come together or alone.
    params = SamplingParams(n=2, max_new_tokens=10)
    seeds = [request_seed(3, 1, r.index, k) for r in records[:4] for k in range(2)]
    together = engine.generate(records[:4], params, seeds, tokenizer).response_ids
    alone = [engine.generate([r], params, seeds[2 * i: 2 * i + 2], tokenizer).response_ids for i, r in enumerate(records[:4])]
    width = together.shape[1]
    results["batch_invariant"] = all(torch.equal(torch.nn.functional.pad(a, (0, width - a.shape[1])), together[2 * i: 2 * i + 2])
                                     for i, a in enumerate(alone))
    results["seeded_again"] = torch.equal(engine.generate(records[:4], params, seeds, tokenizer).response_ids, together)

    # New weights: before the sync the engine still has the old ones; after it, greedy == HF again,
    # although the prompts' KV is in the prefix cache from the generations above.
    perturb(model, 0)
    results["before_sync"] = same_greedy(engine, model, records, tokenizer)
    engine.load_weights(klppo_weights(model, engine))
    results["after_sync"] = same_greedy(engine, model, records, tokenizer)
    results["gap_after_sync"] = log_prob_gap(engine, model, records, tokenizer, 1.0)

    # Prompts longer than a KV block (the cache keeps whole blocks: 128 tokens on CPU): their KV cached under
    # the old weights is forgotten at the sync; without the reset it would be reused.
    long = [dataclasses.replace(r, prompt_ids=(list(r.prompt_ids) * 7)[:200]) for r in records[:8]]
    same_greedy(engine, model, long, tokenizer)  # fills the prefix cache
    perturb(model, 1)
    engine.load_weights(klppo_weights(model, engine))
    results["long_prompts_after_sync"] = same_greedy(engine, model, long, tokenizer)
    engine.llm.reset_prefix_cache = lambda *a, **k: True  # what a sync without the reset would leave
    perturb(model, 2)
    engine.load_weights(klppo_weights(model, engine))
    results["stale_prefix_cache"] = same_greedy(engine, model, long, tokenizer)
    engine.shutdown()
    with open(out, "w") as f:
        json.dump(results, f)


def perturb(model, seed: int) -> None:
    """New weights, as a few updates would give."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + seed)) * 0.05)


def klppo_weights(model, engine):
    """What the trainer streams: ``responses.engine_weights`` of the (unsharded) actor."""
    from klppo.trainer.responses import engine_weights

    return engine_weights(model, torch.float32, torch.device("cpu"), engine.parameter_names)


if __name__ == "__main__":
    main(*sys.argv[1:])
