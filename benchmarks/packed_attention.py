"""Attention for packed rows: each candidate's time on one packed micro-batch, forward and forward + backward.

    OMP_NUM_THREADS=1 python benchmarks/packed_attention.py                      # CPU, fp32 (minutes)
    python benchmarks/packed_attention.py --device cuda --dtype bfloat16         # GPU: every candidate that runs

Workload: one packed row of ``--sequences`` sequences of lengths uniform in [``--min-len``,
``--max-len``] (seeded), through Qwen2-shaped models of each ``--hidden`` size (head size 64, 2
key/value heads, ``--layers`` layers, a 1,024-token vocabulary so that attention, not the head,
is what differs). Each candidate (``klppo.models.attention.ATTENTION_NAMES``) runs
``response_logprobs(packed=True)``: without gradients (old_log_prob, ref) and with a backward
(the update); the time is the mean of ``--repeats`` runs after a warm-up, synchronised on CUDA.
``max_diff`` is the largest log-prob difference from the padded path in the same dtype.
What a run chooses (``packed_attention_for``) follows these figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from klppo.models.attention import ATTENTION_NAMES, set_packed_attention, torch_varlen_runs
from klppo.models.forward import response_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 896], help="model widths (896: Qwen2.5-0.5B's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--attn", nargs="+", choices=list(ATTENTION_NAMES), default=list(ATTENTION_NAMES))
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def runnable(name: str, device: str, dtype: torch.dtype) -> bool:
    """Whether candidate ``name`` runs its own kernel here (varlen and flash: CUDA, bf16 only)."""
    half = dtype != torch.float32
    if name == "varlen":
        return half and torch_varlen_runs(device)
    if name == "flash_attention_2":
        return half and device == "cuda" and importlib.util.find_spec("flash_attn") is not None
    return True


def batch(args, device: str):
    """(B, L) ids and a left-padded mask of ``--sequences`` lengths; the last 64 columns are the response."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.sequences,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(1, 1024, (args.sequences, width), generator=g)
    mask = torch.arange(width)[None] >= (width - lengths)[:, None]
    return ids.to(device), mask.to(device), min(64, args.min_len - 1)


def model(hidden: int, layers: int, dtype: torch.dtype, device: str) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=2, use_cache=False,
                         max_position_embeddings=4096)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def seconds(step, device: str, repeats: int) -> float:
    """Mean wall time of ``step`` after one warm-up run, synchronised on CUDA."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    sync()
    return (time.perf_counter() - start) / repeats


def measure(m, name: str, ids, mask, response: int, args, padded: torch.Tensor) -> dict:
    set_packed_attention(m, ATTENTION_NAMES[name])

    def forward():
        with torch.no_grad():
            return response_logprobs(m, ids, mask, response, packed=True)[0]

    def update():
        m.zero_grad(set_to_none=True)
        response_logprobs(m, ids, mask, response, packed=True)[0].sum().backward()

    diff = (forward() - padded).abs().max().item()  # host sync (once, outside the timing)
    return {"forward_s": seconds(forward, args.device, args.repeats),
            "forward_backward_s": seconds(update, args.device, args.repeats), "max_diff": diff}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    ids, mask, response = batch(args, args.device)
    tokens = int(mask.sum())  # host sync
    print(f"{args.sequences} sequences, {tokens} tokens, {args.layers} layers, {args.dtype} on {args.device}")
    rows = []
    for hidden in args.hidden:
        m = model(hidden, args.layers, dtype, args.device)
        set_packed_attention(m, "sdpa")
        with torch.no_grad():
            padded = response_logprobs(m, ids, mask, response)[0]
        for name in args.attn:
            if not runnable(name, args.device, dtype):
                print(f"hidden {hidden:4d}  {name:<18} does not run here")
                continue
            row = {"hidden": hidden, "attn": name, **measure(m, name, ids, mask, response, args, padded)}
            rows.append(row)
            print(f"hidden {hidden:4d}  {name:<18} forward {row['forward_s']:8.3f} s   forward+backward "
                  f"{row['forward_backward_s']:8.3f} s   max |log-prob - padded| {row['max_diff']:.2e}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"tokens": tokens, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
