"""Export a (sharded) model as a Hugging Face folder that ``from_pretrained`` loads, streamed.

The whole tensors come a group at a time (one decoder block, or a run of the root's own
parameters: ``klppo.distributed.whole_tensor_groups``), and rank 0 writes them into safetensors
files of about ``shard_bytes`` each as they arrive, keeping none of them once written: no rank
holds more than its own shards and one group of whole tensors (a 0.5B model gathered whole
cost 2 GB more on rank 0; buffering a 512 MiB file was the peak of a 2-rank LoRA run).
Several files get transformers' index (``model.safetensors.index.json``); one file is ``model.safetensors``.

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

from klppo.distributed import SINGLE_PROCESS, DistEnv, barrier, plain_class, whole_tensor_groups

SHARD_BYTES = 4 << 30  # the size of one safetensors file (transformers' limit is 5 GB); not held in memory
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
ALIGNMENT = 8  # the safetensors header is padded to this, so every tensor starts aligned

Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (safetensors is little-endian, as are the CPUs torch runs on)."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class _StreamedFile:
    """One safetensors file written a tensor at a time, holding none of them.

    A safetensors file begins with a header that lists every tensor's dtype, shape and offsets,
    which are known only once the last tensor has come. So the tensors' bytes go to a spool file
    as they arrive (and are dropped), and ``finish`` writes the header followed by the spool,
    copied in chunks: memory stays at one tensor, the disk writes the data twice.
    """

    def __init__(self, path: Path) -> None:
        self.path, self.spool_path = path, path.with_suffix(".spool")
        self.spool = open(self.spool_path, "wb")
        self.header: dict[str, dict] = {}
        self.nbytes = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: safetensors has no dtype for {tensor.dtype}")
        data = _raw_bytes(tensor)
        self.spool.write(data)
        self.header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self.nbytes, self.nbytes + data.nbytes]}
        self.nbytes += data.nbytes

    def finish(self) -> None:
        self.spool.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-(len(header) + 8) % ALIGNMENT)
        with open(self.path, "wb") as out, open(self.spool_path, "rb") as spool:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(spool, out, 64 << 20)
        self.spool_path.unlink()


class _ShardWriter:
    """Streams tensors into safetensors files of about ``limit`` bytes each."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.current: _StreamedFile | None = None
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, its tensor names)
        self.total = 0
        self.dtype: torch.dtype | None = None  # of the first floating tensor: the config's dtype

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if self.current is None:
                self.current = _StreamedFile(self.folder / f"part-{len(self.files) + 1:05d}.safetensors")
            self.current.write(name, tensor)
            if self.dtype is None and tensor.is_floating_point():
                self.dtype = tensor.dtype
        if self.current is not None and self.current.nbytes >= self.limit:
            self._finish_file()

    def _finish_file(self) -> None:
        if self.current is None:
            return
        self.current.finish()
        self.total += self.current.nbytes
        self.files.append((self.current.path.name, list(self.current.header)))
        self.current = None

    def close(self) -> None:
        """Finish the file being written and give the files transformers' names (and index)."""
        self._finish_file()
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
        del group  # before the next group is gathered
    if writer is not None:
        writer.close()
        _write_configs(model, tmp, writer.dtype)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    barrier()
    return out
