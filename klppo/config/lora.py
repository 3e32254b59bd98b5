"""The LoRA keys of a model section (verl's ``lora_rank``, ``lora_alpha``, ``target_modules``,
``exclude_modules``, ``lora_adapter_path``): whether they switch LoRA on, and what is wrong with them.

A saved adapter (``lora_adapter_path``) is checked here, before any model loads: a folder in
peft's layout (``adapter_config.json`` and ``adapter_model.safetensors``, or ``.bin``) of a
plain LoRA adapter. Whether its target modules exist in the model is known only once the
model is built (``klppo.models.lora.add_adapters`` names the model's linear layers then).
"""

from __future__ import annotations

import json
from pathlib import Path

from klppo.config.schema import LoraKeys

CONFIG_FILE, WEIGHT_FILES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# peft options klppo's merge, export and reference do not model: an adapter using them is refused.
UNSUPPORTED = {"use_dora": "DoRA", "use_rslora": "rank-stabilised scaling", "rank_pattern": "per-layer ranks",
               "alpha_pattern": "per-layer alphas", "layers_to_transform": "a subset of layers"}


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
    used = [what for option, what in UNSUPPORTED.items() if raw.get(option)]
    if used:
        return [(key, f"{key}: the adapter in '{folder}' uses {', '.join(used)}, which klppo does not support; "
                 "train a plain LoRA adapter, or merge this one into the model folder")]
    if model_cfg.lora_rank not in (0, rank):
        return [(f"{prefix}.lora_rank", f"{prefix}.lora_rank = {model_cfg.lora_rank}, but the adapter in {key} has "
                 f"rank {rank}: set {prefix}.lora_rank={rank} (or 0: the adapter's config decides rank, alpha and "
                 "target_modules)")]
    return []
