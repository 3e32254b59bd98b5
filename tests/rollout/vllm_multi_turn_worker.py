"""vLLM's multi-turn conversations against the trainer's log-probs: ``python vllm_multi_turn_worker.py MODEL TOOLS OUT``.

The random tiny model seldom writes a tool call or an EOS, so every turn here calls the gsm8k tool
and lasts at most 6 tokens (the engine's own samples and log-probs, nothing appended). Written out:
each conversation's turns, how many reply tokens the batch holds, and the largest gap between the
engine's log-probs of the policy's tokens and the fp32 actor's over the whole conversation.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from klppo.data.batching import MicroBatching
from klppo.data.rl_dataset import PromptRecord
from klppo.models.load import load_tokenizer
from klppo.rollout import multi_turn
from klppo.rollout.hf import SamplingParams
from klppo.rollout.multi_turn import MultiTurn
from klppo.rollout.tools import ToolCall, load_tools
from klppo.rollout.vllm import VLLMEngine, request_seed
from klppo.trainer.forwards import compute_log_prob
from klppo.trainer.responses import engine_weights
from tests.fake_vllm import engine_settings

CPU = torch.device("cpu")


def main(model_dir: str, tools_path: str, out: str) -> None:
    multi_turn.TOOL_CALL_PARSERS["hermes"] = lambda text: [ToolCall("calc_gsm8k_reward", json.dumps({"answer": text[-3:]}))]
    real_turns = VLLMEngine._turns

    def short_turns(self, params, seeds, eos):
        generate = real_turns(self, params, seeds, eos)
        return lambda rows, contexts, budgets: generate(rows, contexts, [min(b, 6) for b in budgets])

    VLLMEngine._turns = short_turns
    tokenizer = load_tokenizer(model_dir)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    settings = engine_settings(max_model_len=256, kv_cache_memory_bytes=1 << 26, sleep_between_generations=False,
                               rows_per_generation=8)
    engine = VLLMEngine(model_dir, actor.config, settings, CPU, False, 8 << 30, generation_config=actor.generation_config)
    engine.load_weights(engine_weights(actor, settings.dtype, CPU, engine.parameter_names))
    records = [PromptRecord(i, "openai/gsm8k", "q", tokenizer.encode(f"What is {i} + {i}?"), str(2 * i),
                            {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": str(2 * i)}}}})
               for i in range(4)]
    seeds = [request_seed(7, 0, r.index, k) for r in records for k in range(2)]
    batch = engine.generate(records, SamplingParams(n=2, max_new_tokens=160), seeds, tokenizer,
                            MultiTurn(load_tools(tools_path), max_assistant_turns=3, max_tool_response_length=24))
    engine.shutdown()
    trained = compute_log_prob(actor, batch, MicroBatching(), temperature=1.0)
    gap = (trained - batch.rollout_log_probs).abs()[batch.response_mask].max()
    replies = int((batch.response_attention & ~batch.response_mask).sum())
    with open(out, "w") as f:
        json.dump({"turns": batch.num_turns.tolist(), "replies": replies, "gap": float(gap)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
