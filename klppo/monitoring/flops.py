"""FLOPs of a decoder-only transformer, model FLOPs utilisation (MFU) and peak memory.

FLOPs count what the model runs on real tokens (padding is not useful work), in the PaLM MFU
convention (Chowdhery et al. 2022, appendix B) with two corrections to verl's FlopsCounter,
which charges the vocabulary projection twice (embedding + head) for every token and
attention as if it were not causal:
- each decoder layer's projections (q, k, v, o; gate, up, down): 2 FLOPs per weight per token;
  of a mixture of experts, the experts a token is routed to (top-k of them) and the router
  (``decoder_weights_per_token``, counted on the model itself);
- attention scores and weighted values, causal: a sequence of n tokens has n (n + 1) / 2
  query-key pairs (flash attention and klppo's packed sdpa skip the masked half), 4 x heads
  x head_dim FLOPs per pair and layer (QK^T and AV); a sliding-window layer (Mistral, Gemma 3,
  GPT-OSS, ...) of window W pairs each token with its last W tokens only;
- the head: 2 x hidden x outputs per position whose head output is computed. The LM head of
  an update or log-prob forward runs only where log-probs are read (``logits_to_keep`` /
  packed reads: the response tokens), a value head (1 output) at every token;
- the embedding lookup: none.
Training is 3 passes (forward, and backward's two); recomputation (gradient checkpointing,
the fused head's backward) is not counted, as MFU conventionally leaves it out.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

# Dense peak FLOP/s by device name: (fragments that must all appear in the name, case
# ignored; bf16 and fp16 peak; fp32 peak without TF32), most specific first, first match wins.
# The H100 comes as SXM5 ("NVIDIA H100 80GB HBM3"), PCIe and NVL cards with different peaks.
DEVICE_PEAKS = (
    (("H100", "PCIE"), 756e12, 51e12),
    (("H100", "NVL"), 835e12, 60e12),
    (("H200", "NVL"), 835e12, 60e12),
    (("H100",), 989e12, 67e12),
    (("H200",), 989e12, 67e12),
    (("A100",), 312e12, 19.5e12),
)
HALF = (torch.bfloat16, torch.float16)


# Config keys of a mixture of experts' experts per token (top-k), by model family: most, ERNIE 4.5,
# Hunyuan and LongCat.
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")


def model_flops(config, seq_lens: list[int], *, training: bool, head_positions: int | None = None,
                head_outputs: int | None = None, layer_weights: int | None = None) -> float:
    """FLOPs of one pass over sequences of ``seq_lens`` real tokens (Llama/Qwen2-shaped config).

    ``head_positions``: positions whose head output is computed (default: every token);
    ``head_outputs``: the head's outputs per position (default: the vocabulary, an LM head);
    ``layer_weights``: the weights one token multiplies through in all decoder layers
    (``decoder_weights_per_token``; default: the dense Llama layout of ``config``).
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    if layer_weights is None:
        layer_weights = layers * dense_layer_weights(config)
    tokens = sum(seq_lens)
    pairs = sum(causal_pairs(n, window) for window in attention_windows(config) for n in seq_lens)
    positions = tokens if head_positions is None else head_positions
    outputs = config.vocab_size if head_outputs is None else head_outputs
    forward = 2 * layer_weights * tokens + 4 * q * pairs + 2 * h * outputs * positions
    return (3 if training else 1) * forward


def causal_pairs(n: int, window: int | None = None) -> int:
    """Query-key pairs of causal attention over ``n`` tokens; with a sliding ``window``, token i sees
    the tokens j with i - window < j <= i."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def attention_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers' configs say it:
    ``layer_types`` where the config has them (Gemma 3, Qwen2/3, GPT-OSS, ...), else
    ``sliding_window`` for every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * config.num_hidden_layers


def attention_weights(config) -> int:
    """Weights of one Llama/Qwen2 attention block's projections: q, k, v and o."""
    h = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return h * q + 2 * h * kv + q * h


def dense_layer_weights(config) -> int:
    """Weights of one Llama/Qwen2 decoder layer's projections: attention's, and the MLP's gate, up and down."""
    return attention_weights(config) + 3 * config.hidden_size * config.intermediate_size


def experts_per_token(config) -> int | None:
    """A mixture of experts' top-k, from a config object or its dict; None for a dense model."""
    for key in TOP_K_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: its first (outermost) list of ``num_layers`` modules."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    return None


def decoder_weights_per_token(model: torch.nn.Module, config) -> int | None:
    """The weights one token multiplies through in ``model``'s decoder layers, each 2 FLOPs a token:
    every weight matrix of a layer (LoRA adapters', routers' and shared experts' included; no bias
    or norm), and of a mixture of experts' ``experts`` (transformers' fused 3-d tensors, or a list
    of expert modules) the top-k of their number a token is routed to. Counted on the model, so
    any layout transformers builds (Mixtral's, Qwen-MoE's dense and sparse layers, DeepSeek's
    latent attention) counts as it runs; parameters sharded by FSDP2 count whole. None where the
    layer stack, or a mixture's top-k in ``config``, is not found."""
    layers = decoder_layers(model, config.num_hidden_layers)
    if layers is None:
        return None
    top_k, total = experts_per_token(config), 0
    for name, parameter in layers.named_parameters():
        path = name.split(".")
        if parameter.ndim < 2 or path[-1].endswith("bias"):
            continue
        if "experts" not in path:
            total += parameter.numel()
            continue
        if top_k is None:
            return None
        experts = path.index("experts")
        listed = experts + 1 < len(path) and path[experts + 1].isdigit()
        n_experts = len(layers.get_submodule(".".join(path[:experts + 1]))) if listed else parameter.shape[0]
        total += parameter.numel() * min(top_k, n_experts) // n_experts
    return total


def peak_flops_by_name(name: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of a device called ``name`` computing in ``dtype``, or None where unknown."""
    upper = name.upper()
    for fragments, half, single in DEVICE_PEAKS:
        if all(fragment in upper for fragment in fragments):
            return half if dtype in HALF else single if dtype == torch.float32 else None
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s for ``dtype``, or None where unknown (CPUs, other GPUs)."""
    if device.type != "cuda":
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device), dtype)


def mfu(flops: float, seconds: float, peak: float | None, n_devices: int = 1) -> float | None:
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * n_devices)


@dataclass(frozen=True)
class UpdateWork:
    """What one model's update ran, for its MFU."""

    config: object  # the model's Hugging Face config
    epochs: int  # passes over the rows (ppo_epochs)
    dtype: torch.dtype  # the compute dtype (fsdp_config.dtype); FSDP2's parameters are the fp32 masters
    head_positions: int  # positions whose head output was computed: response tokens (actor), all (critic)
    head_outputs: int | None = None  # head outputs per position: None = the vocabulary; a value head's 1
    layer_weights: int | None = None  # decoder_weights_per_token of the model; None = the config's dense layout
    no_grad_passes: int = 0  # forwards without gradients over the rows beside training (Clip-Cov's picks)


def max_memory_gb(device: torch.device) -> float:
    """Peak memory of the run so far: GPU memory allocated by torch, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def update_efficiency_metrics(device: torch.device, seconds: dict[str, float], lengths: list[int],
                              updated: dict[str, UpdateWork]) -> dict[str, float]:
    """``perf/mfu/<role>`` of each ``update_<role>`` phase where the device's peak is known.

    ``lengths`` are the real tokens of the rows this rank trained on; ``seconds`` the step's
    phase timings; the peak is that of each model's compute dtype.
    """
    metrics = {}
    for role, work in updated.items():
        if f"update_{role}" not in seconds:
            continue
        shape = dict(head_positions=work.head_positions, head_outputs=work.head_outputs, layer_weights=work.layer_weights)
        flops = work.epochs * model_flops(work.config, lengths, training=True, **shape)
        if work.no_grad_passes:
            flops += work.no_grad_passes * model_flops(work.config, lengths, training=False, **shape)
        value = mfu(flops, seconds[f"update_{role}"], peak_flops(device, work.dtype))
        if value is not None:
            metrics[f"perf/mfu/{role}"] = value
    return metrics
