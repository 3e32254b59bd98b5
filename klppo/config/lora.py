"""The LoRA keys of a model section (verl's ``lora_rank``, ``lora_alpha``, ``target_modules``,
``exclude_modules``, ``lora_adapter_path``): whether they switch LoRA on, and what is wrong with them.

A saved adapter (``lora_adapter_path``) is checked here, before any model loads: a folder in
peft's layout (``adapter_config.json`` and ``adapter_model.safetensors``, or ``.bin``) of a
plain LoRA adapter. Every option of its config is either one klppo reads or one that does not
change what the adapter computes, or it must hold peft's default: an adapter trained with
biases, trainable tokens, DoRA and the like would otherwise be loaded in part, without a word.
Whether its target modules exist in the model, its modules_to_save are a head the model trains
and its file holds no tensor left unused, is known only once the model is built
(``klppo.models.lora``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from klppo.config.schema import LoraKeys

CONFIG_FILE, WEIGHT_FILES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json options (peft 0.21's LoraConfig) that klppo reads, or that do not change
# what a saved adapter computes: any value is accepted.
ACCEPTED = {
    "peft_type", "peft_version", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
    "r", "lora_alpha", "target_modules", "exclude_modules",  # read (klppo.models.lora.read_adapter_config)
    "modules_to_save",  # a critic's or reward model's head: checked against the model once it is built
    "lora_dropout",  # training only; klppo trains without dropout (PPO's ratios need one function)
    "fan_in_fan_out",  # peft sets it per layer from the layer's type (Conv1D), and so does klppo
    "megatron_core",  # used only with megatron_config
    "qalora_group_size",  # used only with use_qalora
}
# New adapters start the same way from these (only the initial values differ); other
# initialisations (PiSSA, OLoRA, LoftQ, CorDA, EVA) change the base weights the adapter belongs to.
PLAIN_INITS = (True, False, "gaussian")
# Options klppo's loading, merge, export and reference do not model: (peft's default, what it is).
# An adapter with another value is refused.
NOT_MODELLED = {
    "bias": ("none", "trained biases"), "lora_bias": (False, "a bias on lora_B"),
    "use_dora": (False, "DoRA"), "use_rslora": (False, "rank-stabilised scaling"),
    "rank_pattern": ({}, "per-layer ranks"), "alpha_pattern": ({}, "per-layer alphas"),
    "layers_to_transform": (None, "a subset of layers"), "layers_pattern": (None, "a subset of layers"),
    "trainable_token_indices": (None, "trained token embeddings"), "layer_replication": (None, "replicated layers"),
    "target_parameters": (None, "adapters on parameters (MoE experts)"), "ensure_weight_tying": (False, "tied adapters"),
    "use_qalora": (False, "QA-LoRA"), "megatron_config": (None, "Megatron layers"),
    "alora_invocation_tokens": (None, "activated LoRA"), "loftq_config": ({}, "LoftQ"),
}


def lora_enabled(model_cfg: LoraKeys) -> bool:
    """LoRA is on with a rank above 0 or a saved adapter to start from (verl's rule)."""
    return model_cfg.lora_rank > 0 or model_cfg.lora_adapter_path is not None


def lora_problems(model_cfg: LoraKeys, prefix: str) -> list[tuple[str, str]]:
    """(key, message naming the fix) of each problem with the LoRA keys of section ``prefix``."""
    out = []
    if model_cfg.lora_rank < 0:
        out.append((f"{prefix}.lora_rank", f"{prefix}.lora_rank = {model_cfg.lora_rank} must be >= 0: 0 trains every "
                    "parameter, a rank such as 16 trains LoRA adapters only"))
    if not lora_enabled(model_cfg):
        return out
    if not model_cfg.lora_alpha > 0:
        out.append((f"{prefix}.lora_alpha", f"{prefix}.lora_alpha = {model_cfg.lora_alpha} must be > 0 (the update is "
                    "scaled by lora_alpha / lora_rank); verl's default is 16"))
    if not model_cfg.target_modules:
        out.append((f"{prefix}.target_modules", f"{prefix}.target_modules is empty: set it to all-linear or to a list "
                    "of layer names such as [q_proj,v_proj]"))
    for name in ("target_modules", "exclude_modules"):
        value = getattr(model_cfg, name)
        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                out.append((f"{prefix}.{name}", f"{prefix}.{name} = {value!r} is not a regular expression ({exc}); "
                            "write a valid one, or a list of module names such as [q_proj,v_proj]"))
    if model_cfg.lora_adapter_path is not None:
        out += _adapter_problems(model_cfg, prefix)
    return out


def _adapter_problems(model_cfg: LoraKeys, prefix: str) -> list[tuple[str, str]]:
    key = f"{prefix}.lora_adapter_path"
    folder = Path(model_cfg.lora_adapter_path)
    fix = "point it at a folder that PeftModel.save_pretrained (or a klppo run's *_adapter export) wrote"
    if not (folder / CONFIG_FILE).is_file():
        what = "does not exist" if not folder.exists() else f"has no {CONFIG_FILE}"
        return [(key, f"{key} = '{folder}' {what}; {fix}")]
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return [(key, f"{key} = '{folder}' holds no adapter weights ({' or '.join(WEIGHT_FILES)}); {fix}")]
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        rank = int(raw["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [(key, f"{key}: '{folder / CONFIG_FILE}' cannot be read as a LoRA config ({exc}); {fix}")]
    if raw.get("peft_type") != "LORA":
        return [(key, f"{key}: '{folder}' holds a {raw.get('peft_type')} adapter, not LoRA; {fix}")]
    used = unsupported_options(raw)
    if used:
        return [(key, f"{key}: '{folder / CONFIG_FILE}' sets {'; '.join(used)}, which klppo does not support; "
                 "train a plain LoRA adapter (peft's defaults for these options), or merge this one into the model "
                 "folder")]
    if model_cfg.lora_rank not in (0, rank):
        return [(f"{prefix}.lora_rank", f"{prefix}.lora_rank = {model_cfg.lora_rank}, but the adapter in {key} has "
                 f"rank {rank}: set {prefix}.lora_rank={rank} (or 0: the adapter's config decides rank, alpha and "
                 "target_modules)")]
    return []


def unsupported_options(raw: dict) -> list[str]:
    """``option = value (what it is)`` of each option of a saved adapter's config that klppo would
    ignore: one it does not model, set to other than peft's default, or one it does not know, set
    to anything but an empty value (a newer peft's option, whose effect klppo cannot tell)."""
    out = []
    for option, value in raw.items():
        if option in ACCEPTED:
            continue
        if option == "init_lora_weights":
            if value not in PLAIN_INITS:
                out.append(f"init_lora_weights = {value!r} (an initialisation that changes the base weights)")
        elif option in NOT_MODELLED:
            default, what = NOT_MODELLED[option]
            if value != default:
                out.append(f"{option} = {value!r} ({what})")
        elif value not in (None, False, {}, [], ""):
            out.append(f"{option} = {value!r} (an option klppo does not know)")
    return out
