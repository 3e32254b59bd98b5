"""Generating with a LoRA model: through peft's adapter layers, or with a copy that has the adapters
merged into its weights (what klppo's generation copy does, ``klppo.trainer.responses``).

Builds random Qwen2-shaped models with rank-16 adapters on every linear layer (lora_B non-zero,
as after training), then greedy-decodes the same prompts both ways, on CPU, and prints the
best of three timings of each (merging included for the copy) and whether the tokens agree:

    python benchmarks/lora_generation.py            # one thread
    python benchmarks/lora_generation.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from klppo.models.lora import LoraSpec, add_adapters, initial_adapter_values
from klppo.trainer.responses import generation_copy

# name -> (hidden, layers, heads, kv heads, MLP width, vocabulary), rows, prompt tokens, new tokens
SHAPES = {
    "tiny (hidden 32, 2 layers)": ((32, 2, 2, 1, 64, 384), 16, 24, 128),
    "mid (hidden 512, 8 layers, vocab 8k)": ((512, 8, 8, 2, 1536, 8192), 16, 64, 64),
}
SPEC = LoraSpec("benchmark", rank=16, alpha=32, target_modules="all-linear")


def adapted_model(hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, pad_token_id=0, eos_token_id=1)
    model = Qwen2ForCausalLM(config).eval()
    add_adapters(model, SPEC, train_head=False)
    values = {name: v if ".lora_A." in name else torch.randn_like(v) * 0.01
              for name, v in initial_adapter_values(model, SPEC, seed=0).items()}
    model.load_state_dict(values, strict=False, assign=True)
    return model


def merged_copy(model: Qwen2ForCausalLM) -> Qwen2ForCausalLM:
    return generation_copy(model, torch.float32, torch.device("cpu"))  # klppo's fp32 generation copy


@torch.no_grad()
def generate(model, rows: int, prompt: int, new: int) -> torch.Tensor:
    ids = torch.randint(2, 100, (rows, prompt), generator=torch.Generator().manual_seed(1))
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name, (shape, rows, prompt, new) in SHAPES.items():
        model = adapted_model(*shape)
        generate(model, 2, 4, 2)  # warm-up
        through, merge, merged = [], [], []
        for _ in range(3):  # interleaved, best of three: the machine may be shared
            seconds, a = timed(lambda: generate(model, rows, prompt, new))
            through.append(seconds)
            seconds, copy = timed(lambda: merged_copy(model))
            merge.append(seconds)
            seconds, b = timed(lambda: generate(copy, rows, prompt, new))
            merged.append(seconds)
        total = min(merge) + min(merged)
        print(f"{name}: {rows} x {new} tokens: through adapters {min(through):.2f} s; merged copy "
              f"{min(merge):.2f} s merge + {min(merged):.2f} s generate = {total:.2f} s "
              f"({min(through) / total:.2f}x faster); same tokens: {bool((a == b).all())}")


if __name__ == "__main__":
    main()
