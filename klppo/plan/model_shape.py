"""A model's shape from its folder, without loading it: ``config.json`` and the safetensors headers.

A safetensors file starts with 8 bytes (little-endian u64: the header's length) and then a JSON
header naming every tensor's dtype and shape (https://github.com/huggingface/safetensors), so
the exact parameter count and the dtypes on disk come from a few kilobytes per file. A folder
with ``config.json`` only (a shape to plan for, no weights yet) gets its count from the model
transformers builds from it on the meta device (the Llama / Qwen2 layout the config describes,
the layout ``klppo.monitoring.flops`` counts, where transformers cannot build it). A mixture of
experts' model is built on the meta device too, weights or not: the weights a token multiplies
through (its routed experts only) are counted on it, for the plan's FLOPs and activations.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from klppo.errors import UserError
from klppo.monitoring.flops import (
    attention_weights,
    decoder_layers,
    decoder_weights_per_token,
    dense_layer_weights,
    experts_per_token,
)

HEADER_LIMIT = 100 * 2**20  # safetensors refuses headers above 100 MB; so do we (a corrupt file)

# The role of trainer.gold_reward.model_path, in the plan and in the run (its offloader name).
GOLD_ROLE = "gold_reward_model"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of one model folder (a Llama/Qwen2-shaped decoder)."""

    path: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    parameters: int  # of the causal LM, as ``sum(p.numel() for p in model.parameters())`` counts (tied: once)
    disk_dtypes: tuple[tuple[str, int], ...] = ()  # (safetensors dtype, elements) on disk; () without weights
    # The weights one token multiplies through in all decoder layers, counted on the model built from the
    # config (monitoring.flops.decoder_weights_per_token); None: the dense Llama layout's.
    layer_weights: int | None = None
    # Sliding-window attention, as the config says it (monitoring.flops.attention_windows).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # A mixture of experts (counted on the built model): experts a token is routed to, and the
    # decoder layers that route (the others are dense); 0 and 0 for a dense model.
    routed_experts: int = 0
    sparse_layers: int = 0
    # The folder's tensors are converted as they load (MoE experts stored one by one, fused by
    # transformers 5: ``models.sharded_load.converts_on_load``): no file stays mapped, and a
    # sharded load holds the converted model whole on rank 0.
    converts_on_load: bool = False

    @property
    def mlp_width(self) -> int:
        """The MLP width one token passes through per decoder layer: ``intermediate_size`` for a dense
        model; a mixture of experts' routed experts (top-k x their width) and shared experts together."""
        if self.layer_weights is None:
            return self.intermediate_size
        mlp = self.layer_weights / self.num_hidden_layers - attention_weights(self)
        return max(1, round(mlp / (3 * self.hidden_size)))

    @property
    def lm_head_parameters(self) -> int:
        """The output projection's own parameters: none when it is the embedding (tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def role_parameters(self, role: str) -> int:
        """Parameters of the model a role loads from this folder: the causal LM (actor, reference),
        or its backbone with a one-output head (critic: a biased Linear, as transformers'
        ``*ForTokenClassification``; reward model: an unbiased score, ``*ForSequenceClassification``)."""
        backbone = self.parameters - self.lm_head_parameters
        if role == "critic":
            return backbone + self.hidden_size + 1
        if role in ("reward_model", GOLD_ROLE):
            return backbone + self.hidden_size
        return self.parameters

    @property
    def config(self) -> "ModelShape":
        """Itself: it has the attributes ``klppo.monitoring.flops.model_flops`` reads of a HF config."""
        return self


def read_model_shape(path: str, key: str = "actor_rollout_ref.model.path") -> ModelShape:
    """The shape of the model in folder ``path`` (``key`` names it in errors): config.json, plus the
    safetensors headers' exact count where the folder has weights."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserError(f"{key} = '{path}' has no config.json; point {key} at a Hugging Face model folder")
    config = _text_config(json.loads(config_file.read_text()))
    hf_config = _transformers_config(folder)
    shape = replace(_shape_from_config(str(folder), config, key), **_attention_layout(config, hf_config))
    tensors = _disk_tensors(folder, key)
    counts = _dtype_counts(tensors)
    if hf_config is not None and (not counts or experts_per_token(config) is not None):
        shape = _counted_on_built_model(shape, hf_config, frozenset(tensors) if tensors else None)
    if not counts:
        return shape
    return replace(shape, parameters=_loaded_count(counts, shape), disk_dtypes=tuple(sorted(counts.items())))


def _text_config(config: dict) -> dict:
    """A multimodal config keeps the language model's numbers under ``text_config``."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def _shape_from_config(path: str, c: dict, key: str) -> ModelShape:
    needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [name for name in needed if name not in c]
    if missing:
        raise UserError(f"{key}: {path}/config.json lacks {', '.join(missing)}; the planner reads a Llama/Qwen2-"
                        "shaped decoder's config (as transformers writes it)")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    shape = dict(path=path, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                 num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                 num_key_value_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
                 intermediate_size=c["intermediate_size"], tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))
    return ModelShape(**shape, parameters=_formula_count(shape, bias=_attention_bias(c)))


def _transformers_config(folder: Path):
    """The folder's config as transformers reads it (never running the folder's code), or None
    where transformers cannot (a type it does not ship)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception:  # noqa: BLE001 (whatever stops transformers, the raw keys count instead)
        return None


def _attention_layout(c: dict, hf_config) -> dict:
    """The sliding windows config.json states: transformers' configs set ``layer_types`` from the
    older keys as they load (Qwen2's ``use_sliding_window`` and ``max_window_layers``), so they are
    read from ``hf_config`` where transformers could read the folder (the raw keys otherwise)."""
    text = c if hf_config is None else vars(hf_config.get_text_config())
    types = text.get("layer_types")
    return {"sliding_window": text.get("sliding_window"), "layer_types": None if types is None else tuple(types)}


def _attention_bias(c: dict) -> bool:
    """Qwen2 has biases on q, k and v (its config has no key for it); Llama's ``attention_bias``."""
    return bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe")))


def _formula_count(s: dict, *, bias: bool) -> int:
    """Parameters of a Llama/Qwen2 decoder: embedding, per layer q/k/v/o + gate/up/down + 2 RMSNorms,
    the final norm, and the LM head unless tied."""
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = dense_layer_weights(SimpleNamespace(**s)) + ((q + 2 * kv) if bias else 0) + 2 * h
    head = 0 if s["tie_word_embeddings"] else s["vocab_size"] * h
    return s["vocab_size"] * h + s["num_hidden_layers"] * layer + h + head


def _counted_on_built_model(shape: ModelShape, config, saved: frozenset[str] | None) -> ModelShape:
    """``shape`` with the parameters, layer weights and experts of the causal LM transformers builds
    from the folder's ``config`` (``_transformers_config``), on the meta device (no memory): exact for any type it ships, mixtures
    of experts included, where the Llama layout of ``_formula_count`` counts one dense MLP per layer
    (Qwen3-30B-A3B's config: 2.5B of its 30.5B parameters, and every expert as if each token ran
    through them all). ``saved``: the tensor names in the folder's files (None: no weights), which
    tell whether it converts as it loads. ``shape`` as it is where transformers cannot build it
    (a type it does not ship)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception:  # noqa: BLE001 (whatever stops transformers from building it, the formula counts instead)
        return shape
    text = config.get_text_config()
    layers = decoder_layers(model, text.num_hidden_layers) or []
    sparse = sum(any("experts" in name.split(".") for name, _ in layer.named_parameters()) for layer in layers)
    return replace(shape, parameters=sum(p.numel() for p in model.parameters()),
                   layer_weights=decoder_weights_per_token(model, text),
                   routed_experts=(experts_per_token(text) or 0) if sparse else 0, sparse_layers=sparse,
                   converts_on_load=saved is not None and _converts_on_load(model, saved))


def _converts_on_load(model, saved: frozenset[str]) -> bool:
    """Whether ``from_pretrained`` converts the saved tensors into ``model``'s: the backbone's names are
    not all on disk and transformers has a conversion for the type (the rule of
    ``models.sharded_load.converts_on_load``, which the run's loading follows, on names only)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    backbone = f"{model.base_model_prefix}."
    lacking = any(name.startswith(backbone) and name not in saved for name, _ in model.named_parameters())
    return lacking and bool(get_checkpoint_conversion_mapping(model.config.model_type))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


def read_safetensors_header(path: Path, key: str = "model.path") -> dict:
    """The JSON header of one safetensors file (tensor name -> dtype, shape, offsets); no tensor is read."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise UserError(f"{key}: '{path}' is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > HEADER_LIMIT:
            raise UserError(f"{key}: '{path}' claims a {length}-byte header; the file is damaged: save it again")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _disk_tensors(folder: Path, key: str) -> dict[str, dict]:
    """Every tensor of the folder's weight files: name -> its header entry (dtype, shape, offsets)."""
    tensors: dict[str, dict] = {}
    for file in _weight_files(folder):
        tensors.update(read_safetensors_header(file, key))
    return tensors


def _dtype_counts(tensors: dict[str, dict]) -> Counter:
    """Elements on disk by safetensors dtype (BF16, F32, ...)."""
    counts: Counter = Counter()
    for entry in tensors.values():
        n = 1
        for dim in entry["shape"]:
            n *= dim
        counts[entry["dtype"]] += n
    return counts


def _loaded_count(counts: Counter, shape: ModelShape) -> int:
    """The loaded model's parameter count from the saved tensors: a tied model's file may hold the
    head's copy of the embedding too, which loads as the one shared parameter."""
    total = sum(counts.values())
    if shape.tie_word_embeddings and total - shape.embedding_parameters == shape.parameters:
        return total - shape.embedding_parameters
    return total
