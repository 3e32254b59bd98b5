"""Export a (sharded) model as a Hugging Face folder that ``from_pretrained`` loads, streamed.

The whole tensors come a group at a time (one decoder block, or a run of the root's own
parameters: ``klppo.distributed.whole_tensor_groups``), and rank 0 writes them into safetensors
files of about ``shard_bytes`` each as they arrive, so no rank ever holds the whole model: rank
0's export costs its own shards plus one file's worth of tensors (a 0.5B model gathered whole
cost 2 GB more on rank 0, the largest peak of a 2-rank LoRA run). Several files get
transformers' index (``model.safetensors.index.json``); one file is ``model.safetensors``.

The folder is written to ``<out>.tmp`` and renamed into place, so a crash leaves no half folder.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from klppo.distributed import SINGLE_PROCESS, DistEnv, barrier, plain_class, whole_tensor_groups

SHARD_BYTES = 1 << 29  # 512 MiB: what rank 0 holds before it writes a file
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"

Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class _ShardWriter:
    """Collects tensors and writes a safetensors file whenever ``limit`` bytes are pending."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, its tensor names)
        self.total = 0
        self.dtype: torch.dtype | None = None  # of the first floating tensor: the config's dtype

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.pending[name] = tensor
            if self.dtype is None and tensor.is_floating_point():
                self.dtype = tensor.dtype
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.limit:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in self.pending.items()}, str(self.folder / name),
                  metadata={"format": "pt"})
        self.total += sum(t.numel() * t.element_size() for t in self.pending.values())
        self.files.append((name, list(self.pending)))
        self.pending = {}

    def close(self) -> None:
        """Write what is pending and give the files transformers' names (and index)."""
        self._flush()
        if len(self.files) == 1:
            os.replace(self.folder / self.files[0][0], self.folder / SINGLE_FILE)
            return
        weight_map = {}
        for i, (name, tensors) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            os.replace(self.folder / name, self.folder / final)
            weight_map.update({tensor: final for tensor in tensors})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(model: torch.nn.Module, folder: Path, dtype: torch.dtype | None) -> None:
    """config.json (the plain class as the architecture, not FSDP2's subclass) and, for a model that
    generates, generation_config.json: what ``save_pretrained`` writes next to the weights."""
    cls = plain_class(model)
    config = copy.deepcopy(model.config)
    config.architectures = [cls.__name__]
    config.dtype = dtype or torch.float32
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and cls.can_generate():
        model.generation_config.save_pretrained(folder)


def export_hf(model, tokenizer, out_dir: str | Path, env: DistEnv = SINGLE_PROCESS, transform: Transform | None = None,
              shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``model`` and ``tokenizer`` as a folder that ``from_pretrained`` loads; every rank calls this.

    ``transform`` (rank 0, one group at a time) turns the model's whole tensors into those of
    the plain class that is written (a LoRA model's adapters merged into its weights).
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    writer = None
    if env.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = _ShardWriter(tmp, shard_bytes)
    for group in whole_tensor_groups(model):  # collective
        if writer is not None:
            writer.add(transform(group) if transform is not None else group)
    if writer is not None:
        writer.close()
        _write_configs(model, tmp, writer.dtype)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    barrier()
    return out
