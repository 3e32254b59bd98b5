"""Loading a model that is sharded over ranks, without any rank holding it whole in fp32.

``from_pretrained`` on every rank builds the whole model in fp32 (and then reads its weights),
so N ranks hold N full copies before sharding. Here the model is built with its parameters on
the meta device (no memory; buffers such as rotary frequencies stay real), sharded with FSDP2,
given empty local shards, and only then filled: rank 0 reads one tensor at a time from the
folder's safetensors (or weights-only ``pytorch_model.bin``) and each rank keeps its own shard
of it (``klppo.distributed.fill_sharded``); persistent buffers (trained ones such as DeepSeek-V3's
router bias) are read too and broadcast whole. A parameter the folder lacks is a new head (a
critic's or reward model's one-output layer): rank 0 initialises it as ``from_pretrained``
would, from the same seeded stream, so the weights are bit-identical to loading the folder with
``from_pretrained`` in one process. A folder whose tensors transformers converts as it loads them
(MoE experts stored one by one, fused per layer in the model: ``converts_on_load``) is converted
by ``from_pretrained`` on rank 0, which then holds it once in host memory (``ConvertedWeights``).
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from klppo.errors import UserError, reading
from klppo.models.heads import model_class
from klppo.models.rng import seeded

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers as usual.

    (``torch.device("meta")`` would put the buffers there too, and rotary frequencies and the
    like are computed, not loaded.) Each parameter is moved to meta as it is registered,
    before its initialiser writes to it, so its memory is never touched.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_model(auto_class, config) -> PreTrainedModel:
    """``auto_class``'s model (``heads.model_class``) built from ``config`` in fp32, parameters on the meta
    device (tied ones stay tied)."""
    cls = model_class(auto_class, type(config))
    with parameters_on_meta():
        if cls is auto_class:
            return auto_class.from_config(config, dtype=torch.float32, trust_remote_code=False)
        return cls._from_config(config, dtype=torch.float32)  # what the auto class calls on the class it picks


class WeightReader:
    """The tensors of a model folder by name, read one at a time (safetensors, or weights-only bin)."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder, self.key = folder, key
        self.files = self._files_by_name()

    def _files_by_name(self) -> dict[str, Path]:
        for index in INDEXES:
            if (self.folder / index).is_file():
                with reading(self.folder / index, f"{self.key}: the weight index", "save the model again"):
                    weight_map = json.loads((self.folder / index).read_text())["weight_map"]
                return {name: self.folder / file for name, file in weight_map.items()}
        for single in ("model.safetensors", "pytorch_model.bin"):
            path = self.folder / single
            if path.is_file():
                with reading(path, f"{self.key}: the weights", "copy the folder again, whole"):
                    return {name: path for name in self._names(path)}
        raise UserError(f"{self.key}: '{self.folder}' holds no model weights; point it at a folder save_pretrained wrote")

    @staticmethod
    def _names(path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        return list(torch.load(path, map_location="meta", weights_only=True, mmap=True))

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> torch.Tensor:
        path = self.files[name]
        with reading(path, f"{self.key}: the weights", "copy the folder again, whole"):
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    return f.get_tensor(name)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[name]


def converts_on_load(model: PreTrainedModel, reader: WeightReader) -> bool:
    """Whether ``from_pretrained`` converts this folder's tensors into the model's as it loads them:
    the folder lacks backbone tensors by the model's names, and transformers has a conversion for
    the model type (its ``conversion_mapping``: since transformers 5, MoE experts stored one module
    per expert on disk are one fused tensor per layer in the model; Mixtral's router is renamed)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    backbone = f"{model.base_model_prefix}."
    lacking = any(name.startswith(backbone) and name not in reader for name, _ in model.named_parameters())
    return lacking and bool(get_checkpoint_conversion_mapping(model.config.model_type))


class ConvertedWeights:
    """A folder's tensors under the model's own names, converted as ``from_pretrained`` converts them
    (``converts_on_load``); read as ``WeightReader`` reads (``name in``, ``read``).

    Only the process that reads (``tensors``: rank 0's) loads the folder, whole, with
    ``from_pretrained`` in the folder's own dtype: the conversions (stacking each layer's experts)
    are transformers' own, whatever its version, at the price of rank 0 holding the model once in
    host memory while the ranks fill their shards, as a single process holds it. The other ranks
    get the names (``names``), to check what is missing as rank 0 does.
    """

    def __init__(self, folder: Path, key: str, names: list[str], tensors: dict[str, torch.Tensor] | None = None):
        self.folder, self.key, self.names, self.tensors = folder, key, frozenset(names), tensors

    @classmethod
    def load(cls, auto_class, folder: Path, key: str, config) -> "ConvertedWeights":
        """The folder loaded with the class ``auto_class`` picks for ``config``; the tensors it found."""
        with reading(folder, f"{key}: model folder", "copy the folder again, or save the model again with save_pretrained"):
            model, info = model_class(auto_class, type(config)).from_pretrained(
                folder, config=config, dtype="auto", weights_only=True, output_loading_info=True, trust_remote_code=False)
        missing = set(info["missing_keys"])
        tensors = {name: t.detach() for name, t in model.state_dict().items() if name not in missing}
        return cls(folder, key, list(tensors), tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str) -> torch.Tensor:
        assert self.tensors is not None, "only the reading rank holds the converted tensors"
        return self.tensors[name]


def full_tensors(model: PreTrainedModel, reader: WeightReader | ConvertedWeights, *, new_heads: bool,
                 seed: int = 0) -> Callable[[str], torch.Tensor]:
    """name -> the full tensor of parameter or persistent buffer ``name`` (read, or initialised when
    the folder lacks it).

    Reading happens only when the returned function is called (on rank 0). Persistent buffers
    are read as ``from_pretrained`` reads them: they can be trained (DeepSeek-V3's router bias).
    With ``new_heads``, parameters outside the backbone that the folder lacks are initialised
    module by module, in the model's order, from ``seed``, exactly as ``from_pretrained``
    initialises missing weights, and such buffers keep the value the model was built with; any
    other missing tensor is refused, as ``from_pretrained`` reports it missing.
    """
    backbone = f"{model.base_model_prefix}."
    params = [name for name, _ in model.named_parameters()]
    buffers = _persistent_buffer_names(model)
    missing = [name for name in params + buffers if name not in reader]
    wrong = [name for name in missing if not new_heads or name.startswith(backbone)]
    if wrong:
        raise UserError(f"{reader.key}: the weights in '{reader.folder}' lack '{wrong[0]}' ({len(wrong)} tensors "
                        "missing); copy the folder again, or save the model again with save_pretrained")
    initialised = _initialise(model, [name for name in missing if name not in buffers], seed)
    initialised.update({name: model.get_buffer(name).detach().clone() for name in missing if name in buffers})

    def tensor_of(name: str) -> torch.Tensor:
        return initialised[name] if name in initialised else reader.read(name)

    return tensor_of


def _persistent_buffer_names(model: PreTrainedModel) -> list[str]:
    """The buffers a folder holds: those of the state dict (built on the meta device, it costs nothing)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in params]


def _initialise(model: PreTrainedModel, names: list[str], seed: int) -> dict[str, torch.Tensor]:
    owners = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in names))
    out: dict[str, torch.Tensor] = {}
    # The heads are initialised on the CPU, as from_pretrained initialises them before moving the
    # model: only the CPU stream is seeded (and restored), never a GPU's (klppo.models.rng).
    with seeded(seed, torch.device("cpu")):
        for owner in owners:
            module = copy.deepcopy(model.get_submodule(owner)).to_empty(device="cpu")
            module.apply(model._init_weights)
            for leaf, param in module.named_parameters(recurse=False):
                out[f"{owner}.{leaf}"] = param.detach()
    return out
