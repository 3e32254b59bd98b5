"""FLOPs of a decoder-only transformer, model FLOPs utilisation (MFU) and peak memory.

FLOPs follow verl's FlopsCounter (and the PaLM MFU convention): 2 FLOPs per parameter per
real token for the dense part (attention projections, MLP, embedding + LM head), plus
4 * L^2 * h per layer for QK^T and AV over a sequence of L tokens; training = 3 passes
(forward + backward). Padding is not counted: MFU is useful work over the device's peak.
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense peak FLOP/s per device by (name fragment, dtype); MFU is reported only where known.
PEAK_FLOPS = {
    ("H200", torch.bfloat16): 989e12,
    ("H100", torch.bfloat16): 989e12,
    ("A100", torch.bfloat16): 312e12,
    ("H200", torch.float32): 67e12,
    ("H100", torch.float32): 67e12,
    ("A100", torch.float32): 19.5e12,
}


def model_flops(config, seq_lens: list[int], *, training: bool) -> float:
    """FLOPs of one pass over sequences of ``seq_lens`` real tokens (Llama/Qwen2-shaped config)."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    inter = config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter  # q, k, v, o projections + gate/up/down
    dense = layers * per_layer + 2 * vocab * h
    tokens, squares = sum(seq_lens), sum(n * n for n in seq_lens)
    forward = 2 * dense * tokens + 4 * squares * q * layers
    return (3 if training else 1) * forward


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for ``dtype``, or None where unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for (fragment, kind), peak in PEAK_FLOPS.items() if fragment in name and kind == dtype), None)


def mfu(flops: float, seconds: float, peak: float | None, n_devices: int = 1) -> float | None:
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * n_devices)


def max_memory_gb(device: torch.device) -> float:
    """Peak memory of the run so far: GPU memory allocated by torch, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def update_efficiency_metrics(device: torch.device, seconds: dict[str, float], lengths: list[int],
                              updated: dict[str, tuple[torch.nn.Module, int]]) -> dict[str, float]:
    """``perf/mfu/<role>`` of each ``update_<role>`` phase where the device's peak is known.

    ``updated`` maps a role to (its model, its ppo_epochs); ``lengths`` are the real tokens of
    the rows this rank trained on; ``seconds`` the step's phase timings.
    """
    metrics = {}
    for role, (model, epochs) in updated.items():
        if f"update_{role}" not in seconds:
            continue
        flops = epochs * model_flops(model.config, lengths, training=True)
        value = mfu(flops, seconds[f"update_{role}"], peak_flops(device, next(model.parameters()).dtype))
        if value is not None:
            metrics[f"perf/mfu/{role}"] = value
    return metrics
