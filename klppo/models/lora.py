"""LoRA adapters in a Hugging Face model, built on ``peft``: added, initialised, switched off, merged, saved.

The adapters are peft's LoRA layers, injected into the model's backbone
(``model.<base_model_prefix>``) with ``peft.inject_adapter_in_model``: the model keeps its own
class (``Qwen2ForCausalLM`` stays one, so everything that reads ``model.config``,
``model.model`` or ``model.lm_head`` keeps working), and its adapted linear layers become
``lora.Linear`` modules whose parameters are named ``<module>.base_layer.weight`` (the frozen
weight) and ``<module>.lora_A.default.weight`` / ``<module>.lora_B.default.weight``. Heads
outside the backbone (a causal LM's output layer, a critic's or reward model's one-output
head) never get adapters: a new head trains whole instead (peft's ``modules_to_save``).

Linear layers are ``nn.Linear`` and GPT-2's ``Conv1D``, which stores its weight as (in, out)
(peft's ``fan_in_fan_out``): its update ``B @ A`` is transposed when merged. Any other target
(an ``nn.Embedding``, a convolution) is refused by name when the adapters are added: peft
gives it adapters of another layout, which klppo does not initialise, train or merge.

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
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from klppo.errors import UserError, reading
from klppo.models.heads import is_causal_lm_class

ADAPTER = "default"  # peft's name of the (only) adapter
PEFT_PREFIX = "base_model.model."  # what peft's saved adapter files put before every parameter name
CONFIG_FILE, WEIGHT_FILES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")
# peft task types by the Hugging Face class's suffix: PeftModel.from_pretrained picks its wrapper by them.
TASK_TYPES = {"ForCausalLM": "CAUSAL_LM", "ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS"}

Modules = Union[str, tuple[str, ...], None]


def _task_type(class_name: str) -> str | None:
    """peft's task type of a Hugging Face class: CAUSAL_LM for a causal LM (``is_causal_lm_class``:
    GPT-2's ``GPT2LMHeadModel`` too), else by the name's end."""
    if is_causal_lm_class(class_name):
        return "CAUSAL_LM"
    return next((task for suffix, task in TASK_TYPES.items() if class_name.endswith(suffix)), None)


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of one model, from its config section (verl's keys)."""

    key: str  # the config section, e.g. "actor_rollout_ref.model": messages name its keys
    rank: int  # lora_rank
    alpha: float  # lora_alpha: the update is scaled by alpha / rank
    target_modules: Modules  # "all-linear" or module names (peft's matching: exact or dotted suffix)
    exclude_modules: Modules = None  # names (or a regex) never adapted
    adapter_path: Optional[str] = None  # a saved adapter to start from (its config decides rank, alpha, targets)
    modules_to_save: tuple[str, ...] = ()  # the saved adapter's trained heads (peft's modules_to_save)


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
    return replace(spec, rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", 8)),
                   target_modules=_as_modules(raw.get("target_modules")),
                   exclude_modules=_as_modules(raw.get("exclude_modules")),
                   modules_to_save=tuple(raw.get("modules_to_save") or ()))


def _as_modules(value) -> Modules:
    return tuple(value) if isinstance(value, list) else value


def read_adapter_weights(spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The tensors of the saved adapter, under this model's parameter names (adapter name put back)."""
    path = _weight_file(spec)
    with reading(path, f"{spec.key}.lora_adapter_path: the adapter weights", "save the adapter again"):
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            saved = load_file(str(path))
        else:
            saved = torch.load(path, map_location="cpu", weights_only=True)
    return {_model_name(name): tensor for name, tensor in saved.items()}


def _weight_file(spec: LoraSpec) -> Path:
    folder = Path(spec.adapter_path)
    return next(folder / name for name in WEIGHT_FILES if (folder / name).is_file())


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
    (a critic's or reward model's new head). ``spec`` must be resolved (``read_adapter_config``).
    A target that is not a linear layer is refused, naming it."""
    import warnings

    from peft import LoraConfig, inject_adapter_in_model

    backbone = model.get_submodule(model.base_model_prefix)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                        target_modules=_in_backbone(spec.target_modules, model, _targets_key(spec)),
                        exclude_modules=_in_backbone(spec.exclude_modules, model, _targets_key(spec, "exclude")))
    try:
        with warnings.catch_warnings(), _config_hidden(backbone):
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to")  # said per layer otherwise
            inject_adapter_in_model(config, backbone, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except ValueError as exc:
        raise UserError(f"{_targets_key(spec)} = {spec.target_modules!r} (exclude_modules = "
                        f"{spec.exclude_modules!r}) adapts no layer of this model, or a module that is not a layer "
                        f"({str(exc).splitlines()[0]}); its "
                        f"linear layers are {_linear_names(backbone)}: list some of them, or use all-linear") from None
    _refuse_non_linear(model, spec)
    backbone_prefix = f"{model.base_model_prefix}."
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name) or (train_head and not name.startswith(backbone_prefix)))


@contextmanager
def _config_hidden(backbone: torch.nn.Module):
    """The backbone without its ``config`` while peft injects adapters. For an MoE model peft reads
    the config to load adapters trained on transformers 4, and re-aims every target named like a
    version-4 expert projection (``gate_proj``, ``up_proj``, ``down_proj``: Qwen2-MoE's and
    DeepSeek-V3's shared experts and dense layers too) at version 5's fused expert weights, which
    klppo does not adapt. The targets klppo resolved are the ones meant."""
    config = backbone.__dict__.pop("config", None)
    try:
        yield
    finally:
        if config is not None:
            backbone.config = config


def _targets_key(spec: LoraSpec, which: str = "target") -> str:
    """Where the target (or exclude) modules were set: the config key, or the saved adapter's config."""
    if spec.adapter_path is None:
        return f"{spec.key}.{which}_modules"
    return f"{which}_modules of {spec.key}.lora_adapter_path ('{Path(spec.adapter_path) / CONFIG_FILE}')"


def _linear_names(backbone: torch.nn.Module) -> list[str]:
    """The short names of the layers LoRA can adapt here (``nn.Linear``, and GPT-2's ``Conv1D``), also
    once adapters are in (an adapted layer's own is its ``base_layer``; the adapters' are left out)."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name, m in backbone.named_modules()
                   if isinstance(m, (torch.nn.Linear, Conv1D)) and ".lora_" not in f".{name}"})


def _linear_modules(backbone: torch.nn.Module) -> list[str]:
    """``all-linear``: the full names of the backbone's linear layers (``nn.Linear``, GPT-2's
    ``Conv1D``). peft's own ``all-linear`` also takes what it can wrap otherwise: the fused experts
    of transformers 5's MoE layers (3-D weights) and their routers, which klppo does not adapt;
    those stay frozen, as the embeddings do."""
    from transformers.pytorch_utils import Conv1D

    return [name for name, m in backbone.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def _refuse_non_linear(model: torch.nn.Module, spec: LoraSpec) -> None:
    """peft also adapts embeddings and convolutions, with parameters of another layout (an
    embedding's ``lora_embedding_A``) that klppo would leave uninitialised and frozen, and merge
    wrongly: refuse them by name before anything trains."""
    from peft.tuners.lora import Linear

    other = {name: type(layer.get_base_layer()).__name__ for name, layer in lora_layers(model).items()
             if not isinstance(layer, Linear)}
    if other:
        listed = ", ".join(f"{name} ({kind})" for name, kind in other.items())
        raise UserError(f"{_targets_key(spec)} = {spec.target_modules!r} adapts {listed}: klppo trains LoRA "
                        "adapters of linear layers only (nn.Linear, GPT-2's Conv1D); list only linear layers (its "
                        f"linear layers are {_linear_names(model.get_submodule(model.base_model_prefix))}), or add "
                        "these to exclude_modules")


def _in_backbone(modules: Modules, model: torch.nn.Module, key: str):
    """Module names as peft matches them inside the backbone.

    A list may name modules by their full names (a saved adapter lists
    ``model.layers.0.self_attn.q_proj``): the backbone knows them without its prefix. A string
    other than ``all-linear`` is a regular expression, which peft matches in full against each
    module's name; an adapter saved by peft wrote it against the whole model's names, so it is
    matched here against both the whole model's name and the backbone's, and turned into the list
    of the backbone's modules it selects.
    """
    prefix = f"{model.base_model_prefix}."
    if isinstance(modules, tuple):
        return [name.removeprefix(prefix) for name in modules]
    if modules == "all-linear":
        return _linear_modules(model.get_submodule(model.base_model_prefix))
    if modules is None:
        return modules
    try:
        pattern = re.compile(modules)
    except re.error as exc:
        raise UserError(f"{key} = {modules!r} is not a regular expression ({exc}); write a valid one, or a list "
                        "of module names") from None
    backbone = model.get_submodule(model.base_model_prefix)
    return [name for name, _ in backbone.named_modules()
            if name and (pattern.fullmatch(name) or pattern.fullmatch(prefix + name))]


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
    """The saved adapter's values of ``names`` (and of the trained heads it holds); a file that lacks
    one, or holds a tensor this model would not use, is refused: a tensor left out would be a part
    of the saved adapter silently dropped (a bias, a trained embedding, a head)."""
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
    _check_modules_to_save(spec, heads)
    out = {name: saved[name].float() for name, _ in names}
    out.update({name: saved[name].float() for name, shape in heads.items()
                if name in saved and tuple(saved[name].shape) == tuple(shape)})
    unused = [_file_name(name) for name in saved if name not in out]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise UserError(f"{spec.key}.lora_adapter_path: '{_weight_file(spec)}' holds tensors this model would not use "
                        f"({', '.join(unused[:3])}{more}): the adapter carries more than LoRA adapters of this model's "
                        "linear layers (a bias, a trained embedding or head, another model's layers); merge it into "
                        "the model folder and train new adapters, or point lora_adapter_path at an adapter of this "
                        "base model")
    return out


def _check_modules_to_save(spec: LoraSpec, heads: dict) -> None:
    """peft's ``modules_to_save`` are modules trained whole beside the adapters: klppo trains only a
    critic's or reward model's new head that way (``heads``, the trainable non-adapter parameters)."""
    trained = {name.rsplit(".", 1)[0] for name in heads}
    other = [m for m in spec.modules_to_save if not any(t == m or t.endswith(f".{m}") for t in trained)]
    if other:
        what = f"trains only its new head ({sorted(trained)})" if trained else "trains adapters only"
        raise UserError(f"{spec.key}.lora_adapter_path: '{Path(spec.adapter_path) / CONFIG_FILE}' sets "
                        f"modules_to_save = {list(spec.modules_to_save)!r}, but this model {what}, so {other} would "
                        "be dropped: merge the adapter into the model folder and train new adapters, or point "
                        "lora_adapter_path at an adapter without modules_to_save")


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


def add_adapters_like(copy: torch.nn.Module, model: torch.nn.Module) -> None:
    """Give ``copy`` (a plain model of ``model``'s class, on the meta device) the adapters of
    ``model``: the same layers, rank and alpha, so that it takes ``model``'s parameters by name."""
    layers = lora_layers(model)
    first = next(iter(layers.values()))
    spec = LoraSpec(f"a copy of {type(model).__name__}", rank=first.r[ADAPTER], alpha=first.lora_alpha[ADAPTER],
                    target_modules=tuple(layers))
    add_adapters(copy, spec, train_head=False)


@dataclass(frozen=True)
class AdapterMerge:
    """How one adapted layer's update joins its weight: W + scaling * B @ A."""

    scaling: float  # lora_alpha / r
    fan_in_fan_out: bool  # W is stored as (in, out) (GPT-2's Conv1D), so the (out, in) update B @ A is transposed


def lora_merges(model: torch.nn.Module) -> dict[str, AdapterMerge]:
    """module name -> how its adapter merges (peft's ``scaling`` and ``fan_in_fan_out`` of the layer)."""
    return {name: AdapterMerge(layer.scaling[ADAPTER], bool(layer.fan_in_fan_out))
            for name, layer in lora_layers(model).items()}


def merged_state(state: dict[str, torch.Tensor], merges: dict[str, AdapterMerge]) -> dict[str, torch.Tensor]:
    """``state`` (an adapted model's whole tensors, or a group of whole modules of them) as the plain
    model's state: every adapted weight merged, W + scaling * B @ A (in fp32, then W's dtype),
    under its plain name; the adapter tensors dropped. Entries are taken out of ``state`` as they
    are merged (a gathered copy is freed as it goes); ``merges``: ``lora_merges`` of the model."""
    for module, merge in merges.items():
        if f"{module}.base_layer.weight" not in state:  # another group's module
            continue
        a = state.pop(f"{module}.lora_A.{ADAPTER}.weight")  # (r, in)
        b = state.pop(f"{module}.lora_B.{ADAPTER}.weight")  # (out, r)
        weight = state.pop(f"{module}.base_layer.weight")  # (out, in), or (in, out) with fan_in_fan_out
        update = merge.scaling * (b.float() @ a.float())
        state[f"{module}.weight"] = (weight.float() + (update.T if merge.fan_in_fan_out else update)).to(weight.dtype)
        if f"{module}.base_layer.bias" in state:
            state[f"{module}.bias"] = state.pop(f"{module}.base_layer.bias")
    return state


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
    task = _task_type(type(model).__name__)
    config = LoraConfig(r=first.r[ADAPTER], lora_alpha=first.lora_alpha[ADAPTER], lora_dropout=0.0, bias="none",
                        target_modules=sorted(layers), task_type=task, base_model_name_or_path=base_path,
                        fan_in_fan_out=all(layer.fan_in_fan_out for layer in layers.values()),  # as peft saves GPT-2's
                        modules_to_save=sorted({name.rsplit(".", 1)[0] for name in heads}) or None)
    names = [name for name in state if is_adapter(name)] + heads
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({_file_name(name): state[name].detach().contiguous() for name in names},
              str(out / WEIGHT_FILES[0]))
