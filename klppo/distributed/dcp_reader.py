"""Reading DCP checkpoints without running code from them.

``torch.distributed.checkpoint`` (torch 2.13) reads a checkpoint's ``.metadata`` file with a
plain ``pickle.load``, and its default planner loads every non-tensor value (the optimiser's
hyper-parameters, saved as bytes) with ``torch.load(weights_only=False)``: a crafted checkpoint
runs code on load. Tensors are already read with ``weights_only=True``. klppo reads the other
two through narrower doors:

- the metadata through an unpickler that admits only the classes DCP itself writes there (the
  list below is what saving the tiny model's actor, critic and optimisers wrote, in one
  process and with FSDP2 on two ranks);
- the non-tensor values with ``weights_only=True``, like the tensors.

``read_sharded_contents`` describes a checkpoint (its keys and shapes, its shard files and how
long they must be) from the metadata alone, so a resume target can be checked before anything
is loaded or written.
"""

from __future__ import annotations

import importlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"  # the name DCP's FileSystemWriter gives the global metadata

_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = frozenset(
    {(f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )}
    | {
        (f"{_DCP}.filesystem", "_StorageInfo"),  # where each item lies: shard file, offset, length
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch.strided pickles: a lookup by name
        # StorageMeta.checkpoint_id is the folder as saved; Python 3.13 moved the classes.
        *{(module, cls) for module in ("pathlib", "pathlib._local")
          for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata classes, torch dtypes, sizes and paths; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata_file(path: str | Path) -> Metadata:
    """The DCP ``Metadata`` in ``path``; raises (OSError, pickle.UnpicklingError, ...) if it is not one,
    and ValueError if it names a shard file outside its folder (``_check_shard_name``)."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    # FileSystemReader opens each item's relative_path joined to the folder, and pathlib lets an
    # absolute path or '..' escape it: every read of a checkpoint (resume, rollback) comes here.
    for info in (metadata.storage_data or {}).values():
        _check_shard_name(getattr(info, "relative_path", None))
    return metadata


def _check_shard_name(name: Any) -> None:
    """A ValueError unless ``name`` is a plain file name inside the checkpoint folder (DCP writes flat
    names such as ``__0_0.distcp``; a path, '..' or an absolute name points elsewhere)."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise ValueError(f"it names the shard {name!r}, which is not a file in its folder")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata read runs no code (``read_metadata_file``)."""

    def read_metadata(self) -> Metadata:
        # No ``rank`` keyword: DCP then never falls back to per-rank metadata files, which klppo
        # does not write (a failed read is the error, not a reason to look elsewhere).
        metadata = read_metadata_file(Path(self.path) / METADATA_FILE)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


@dataclass(frozen=True)
class ShardedContents:
    """What a DCP checkpoint holds, as its metadata says."""

    keys: dict[str, tuple[int, ...] | None]  # flattened key -> global shape; None for a non-tensor value
    files: dict[str, int]  # shard file name -> the bytes it must hold at least


def read_sharded_contents(folder: str | Path) -> ShardedContents:
    """Describe the DCP checkpoint in ``folder`` from its metadata alone (no shard is read)."""
    metadata = read_metadata_file(Path(folder) / METADATA_FILE)
    keys: dict[str, tuple[int, ...] | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise pickle.UnpicklingError(f"key {key} has no storage description")
        keys[key] = tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
    files: dict[str, int] = {}
    for info in metadata.storage_data.values():  # names checked by read_metadata_file
        name = info.relative_path
        files[name] = max(files.get(name, 0), int(info.offset) + int(info.length))
    return ShardedContents(keys, files)


def requested_keys(state: dict) -> dict[str, tuple[int, ...] | None]:
    """The flattened keys (and global shapes) that ``load_sharded(state, ...)`` will ask a checkpoint for."""
    flat, _ = flatten_state_dict(state)
    return {key: tuple(value.size()) if isinstance(value, torch.Tensor) else None for key, value in flat.items()}
