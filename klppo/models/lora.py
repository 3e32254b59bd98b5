"""LoRA adapters in a Hugging Face model, built on ``peft``: added, initialised, switched off, merged, saved.

The adapters are peft's LoRA layers, injected into the model's backbone
(``model.<base_model_prefix>``) with ``peft.inject_adapter_in_model``: the model keeps its own
class (``Qwen2ForCausalLM`` stays one, so everything that reads ``model.config``,
``model.model`` or ``model.lm_head`` keeps working), and its adapted linear layers become
``lora.Linear`` modules whose parameters are named ``<module>.base_layer.weight`` (the frozen
weight) and ``<module>.lora_A.default.weight`` / ``<module>.lora_B.default.weight``. Heads
outside the backbone (a causal LM's output layer, a critic's or reward model's one-output
head) never get adapters: a new head trains whole instead (peft's ``modules_to_save``).

Adapters are created on the meta device and given their values afterwards, the same way on
one process and on sharded ranks: peft's default initialisation (lora_A kaiming-uniform as
``nn.Linear``, lora_B zero, so the adapted model starts as the base model) drawn from a
generator seeded with the run's seed, parameter by parameter in the model's order, or the
values of a saved adapter (``lora_adapter_path``). Saved adapters use peft's own layout
(``adapter_config.json`` + ``adapter_model.safetensors``), which
``PeftModel.from_pretrained(base, folder)`` loads.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch

from klppo.errors import UserError, reading

ADAPTER = "default"  # peft's name of the (only) adapter
PEFT_PREFIX = "base_model.model."  # what peft's saved adapter files put before every parameter name
CONFIG_FILE, WEIGHT_FILES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# peft task types by the Hugging Face class's suffix: PeftModel.from_pretrained picks its wrapper by them.
TASK_TYPES = {"ForCausalLM": "CAUSAL_LM", "ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS"}

Modules = Union[str, tuple[str, ...], None]


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of one model, from its config section (verl's keys)."""

    key: str  # the config section, e.g. "actor_rollout_ref.model": messages name its keys
    rank: int  # lora_rank
    alpha: float  # lora_alpha: the update is scaled by alpha / rank
    target_modules: Modules  # "all-linear" or module names (peft's matching: exact or dotted suffix)
    exclude_modules: Modules = None  # names (or a regex) never adapted
    adapter_path: Optional[str] = None  # a saved adapter to start from (its config decides rank, alpha, targets)


# ---- saved adapters ----


def read_adapter_config(spec: LoraSpec) -> LoraSpec:
    """``spec`` with the rank, alpha and target modules of the adapter it starts from (if any).

    The folder was checked with the config (``klppo.config.checks``); here its values are read.
    """
    if spec.adapter_path is None:
        return spec
    path = Path(spec.adapter_path) / CONFIG_FILE
    with reading(path, f"{spec.key}.lora_adapter_path: the adapter config", "save the adapter again"):
        raw = json.loads(path.read_text(encoding="utf-8"))
    targets = raw.get("target_modules")
    return replace(spec, rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", 8)),
                   target_modules=tuple(targets) if isinstance(targets, list) else targets,
                   exclude_modules=_as_modules(raw.get("exclude_modules")))


def _as_modules(value) -> Modules:
    return tuple(value) if isinstance(value, list) else value


def read_adapter_weights(spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The tensors of the saved adapter, under this model's parameter names (adapter name put back)."""
    folder = Path(spec.adapter_path)
    path = next(folder / name for name in WEIGHT_FILES if (folder / name).is_file())
    with reading(path, f"{spec.key}.lora_adapter_path: the adapter weights", "save the adapter again"):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            saved = load_file(str(path))
        else:
            saved = torch.load(path, map_location="cpu", weights_only=True)
    return {_model_name(name): tensor for name, tensor in saved.items()}


def _model_name(saved: str) -> str:
    """peft's file name of a parameter -> the name in a model with injected adapters."""
    name = saved.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return name


def _file_name(name: str) -> str:
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


# ---- adding adapters ----


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The name a parameter has in the model without adapters (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def add_adapters(model: torch.nn.Module, spec: LoraSpec, *, train_head: bool) -> None:
    """Inject LoRA layers (parameters on the meta device) into ``model``'s backbone and freeze the
    rest: only the adapters train, and with ``train_head`` the parameters outside the backbone too
    (a critic's or reward model's new head). ``spec`` must be resolved (``read_adapter_config``)."""
    from peft import LoraConfig, inject_adapter_in_model

    backbone = model.get_submodule(model.base_model_prefix)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                        target_modules=_in_backbone(spec.target_modules, model),
                        exclude_modules=_in_backbone(spec.exclude_modules, model))
    try:
        inject_adapter_in_model(config, backbone, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in backbone.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise UserError(f"{spec.key}.target_modules = {spec.target_modules!r} (exclude_modules = "
                        f"{spec.exclude_modules!r}) adapts no layer of this model ({str(exc).splitlines()[0]}); its "
                        f"linear layers are {linear}: list some of them, or use all-linear") from None
    backbone_prefix = f"{model.base_model_prefix}."
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name) or (train_head and not name.startswith(backbone_prefix)))


def _in_backbone(modules: Modules, model: torch.nn.Module):
    """Module names as peft matches them inside the backbone: a saved adapter lists full names
    (``model.layers.0.self_attn.q_proj``), the backbone knows them without its prefix."""
    if not isinstance(modules, tuple):
        return modules
    return [name.removeprefix(f"{model.base_model_prefix}.") for name in modules]


def initial_adapter_values(model: torch.nn.Module, spec: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """name -> the starting value (CPU, fp32) of every adapter parameter, and of a trained head a
    saved adapter carries.

    A saved adapter (``spec.adapter_path``) gives them all; otherwise peft's default
    initialisation is drawn from a generator seeded with ``seed``, one parameter after the
    other in the model's order, so any number of ranks gets the same values.
    """
    names = [(name, param.shape) for name, param in model.named_parameters() if is_adapter(name)]
    if spec.adapter_path is not None:
        return _saved_values(model, spec, names)
    generator, out = torch.Generator().manual_seed(seed), {}
    for name, shape in names:
        value = torch.zeros(shape)
        if ".lora_A." in name:  # peft's reset_lora_parameters: nn.Linear's own init for A, zeros for B
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        out[name] = value
    return out


def _saved_values(model: torch.nn.Module, spec: LoraSpec, names: list) -> dict[str, torch.Tensor]:
    saved = read_adapter_weights(spec)
    where = f"{spec.key}.lora_adapter_path: the adapter in '{spec.adapter_path}'"
    for name, shape in names:
        if name not in saved:
            raise UserError(f"{where} lacks '{_file_name(name)}'; it was not trained for this model (or with other "
                            "target_modules): point lora_adapter_path at an adapter of this base model")
        if tuple(saved[name].shape) != tuple(shape):
            raise UserError(f"{where} holds '{_file_name(name)}' of shape {tuple(saved[name].shape)}, but this model "
                            f"needs {tuple(shape)}: point lora_adapter_path at an adapter of this base model")
    heads = {name: p.shape for name, p in model.named_parameters() if p.requires_grad and not is_adapter(name)}
    out = {name: saved[name].float() for name, _ in names}
    out.update({name: saved[name].float() for name, shape in heads.items()
                if name in saved and tuple(saved[name].shape) == tuple(shape)})
    return out


def with_adapters(model: torch.nn.Module, spec: LoraSpec, tensor_of: Callable[[str], torch.Tensor], *, seed: int,
                  train_head: bool) -> Callable[[str], torch.Tensor]:
    """Add adapters to the (meta-device) ``model``; returns ``tensor_of`` for the adapted names:
    base weights under their plain names, adapters (and a saved head) their starting values."""
    add_adapters(model, spec, train_head=train_head)
    initial = initial_adapter_values(model, spec, seed)
    return lambda name: initial[name] if name in initial else tensor_of(base_name(name))


def attach_adapters(model: torch.nn.Module, spec: LoraSpec, *, seed: int, train_head: bool) -> None:
    """Add adapters to a loaded ``model`` and give them (and a saved head) their starting values."""
    add_adapters(model, spec, train_head=train_head)
    device = next(p.device for p in model.parameters() if not p.is_meta)
    initial = {name: value.to(device) for name, value in initial_adapter_values(model, spec, seed).items()}
    model.load_state_dict(initial, strict=False, assign=True)  # keeps each parameter's requires_grad


# ---- using adapted models ----


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapters (peft is never imported for a model without them)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """module name -> peft LoRA layer, in the model's order."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``model`` computes with its base weights only (peft's ``disable_adapter``):
    the reference policy of a LoRA actor, at no cost in memory. Every parameter's
    ``requires_grad`` is as before afterwards."""
    layers = lora_layers(model).values()
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in flags:
            param.requires_grad_(flag)


def merged_state(state: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """``state`` (an adapted model's whole tensors, or a group of whole modules of them) as the plain
    model's state: every adapted weight merged, W + scaling * B @ A (in fp32, then W's dtype),
    under its plain name; the adapter tensors dropped. Entries are taken out of ``state`` as they
    are merged (a gathered copy is freed as it goes); ``scalings``: module name -> lora_alpha / r
    (``lora_scalings``)."""
    for module, scaling in scalings.items():
        if f"{module}.base_layer.weight" not in state:  # another group's module
            continue
        a = state.pop(f"{module}.lora_A.{ADAPTER}.weight")
        b = state.pop(f"{module}.lora_B.{ADAPTER}.weight")
        weight = state.pop(f"{module}.base_layer.weight")
        state[f"{module}.weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
        if f"{module}.base_layer.bias" in state:
            state[f"{module}.bias"] = state.pop(f"{module}.base_layer.bias")
    return state


def merging(model: torch.nn.Module) -> Optional[Callable[[dict], dict]]:
    """``state -> merged_state(state, ...)`` for ``model``'s adapters; None for a model without any."""
    if not has_adapters(model):
        return None
    scalings = lora_scalings(model)
    return lambda state: merged_state(state, scalings)


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """module name -> the scale of its adapter's update (lora_alpha / r)."""
    return {name: layer.scaling[ADAPTER] for name, layer in lora_layers(model).items()}


def trained_heads(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters that are not adapters (a critic's or reward model's head)."""
    return [name for name, p in model.named_parameters() if p.requires_grad and not is_adapter(name)]


def save_adapter(out: Path, model: torch.nn.Module, state: dict[str, torch.Tensor], base_path: str) -> None:
    """Write ``model``'s adapters (and trained head) from their whole tensors in ``state`` into folder
    ``out`` in peft's layout, for ``PeftModel.from_pretrained(<the model of base_path>, out)``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    layers, heads = lora_layers(model), trained_heads(model)
    first = next(iter(layers.values()))
    task = next((task for suffix, task in TASK_TYPES.items() if type(model).__name__.endswith(suffix)), None)
    config = LoraConfig(r=first.r[ADAPTER], lora_alpha=first.lora_alpha[ADAPTER], lora_dropout=0.0, bias="none",
                        target_modules=sorted(layers), task_type=task, base_model_name_or_path=base_path,
                        modules_to_save=sorted({name.rsplit(".", 1)[0] for name in heads}) or None)
    names = [name for name in state if is_adapter(name)] + heads
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({_file_name(name): state[name].detach().contiguous() for name in names},
              str(out / WEIGHT_FILES[0]))
