"""Allow-list unpicklers for the two pickles a DCP checkpoint holds.

* `.metadata`: only the DCP metadata classes, ``torch.Size``, torch dtypes, the layout helper,
  pathlib paths and ``OrderedDict`` may be referenced; anything else is refused.
* a chunk record's ``data.pkl``: parsed without loading storages or running torch's rebuild
  functions; the result is a plain description of the stored tensor.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"

# the classes of torch.distributed.checkpoint.metadata a `.metadata` pickle may name
_DCP_METADATA_NAMES = (
    "Metadata",
    "TensorStorageMetadata",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)

# (module, name) a metadata pickle may reference -> the name of today's class. Older torch
# versions kept some classes elsewhere; those paths map onto the same names.
_METADATA_CLASSES: dict[tuple[str, str], str] = {
    **{(_DCP_METADATA, n): n for n in _DCP_METADATA_NAMES},
    (_DCP_FILESYSTEM, "_StorageInfo"): "_StorageInfo",
    # torch 2.2 kept TensorProperties and its memory-format enum in the sharded-tensor package
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): "TensorProperties",
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): (
        "_MEM_FORMAT_ENCODING"
    ),
    ("torch", "Size"): "Size",
    ("torch.serialization", "_get_layout"): "_get_layout",
    ("collections", "OrderedDict"): "OrderedDict",
    ("pathlib", "PosixPath"): "PurePosixPath",
    ("pathlib", "PurePosixPath"): "PurePosixPath",
    ("pathlib", "WindowsPath"): "PureWindowsPath",
    ("pathlib", "PureWindowsPath"): "PureWindowsPath",
}

# the torch dtype objects a pickle may name (torch.float32, torch.bfloat16, ...)
_DTYPE_NAMES: frozenset[str] = frozenset(
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)
)


class PickledRecord:
    """The attributes of one pickled DCP metadata object, without torch's class or its code.

    Unpickling fills ``__dict__`` from the pickled state; missing fields (older torch) are
    simply absent (read them with ``getattr(obj, name, default)``).
    """

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            raise TypeError(f"unexpected pickled state for {type(self).__name__}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


class Metadata(PickledRecord):
    """`state_dict_metadata`, `planner_data`, `storage_data` (and newer fields)."""

    state_dict_metadata: dict[str, Any]
    planner_data: Any
    storage_data: dict[Any, Any]


class TensorStorageMetadata(PickledRecord):
    """`properties`, `size`, `chunks`."""

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkStorageMetadata]


class ChunkStorageMetadata(PickledRecord):
    """`offsets`, `sizes`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class BytesStorageMetadata(PickledRecord):
    """A non-tensor entry."""


class MetadataIndex(PickledRecord):
    """`fqn`, `offset`, `index`."""

    fqn: str
    offset: tuple[int, ...] | None


class StorageMeta(PickledRecord):
    """Save ids (torch 2.4+)."""


class StorageInfo(PickledRecord):
    """`relative_path`, `offset`, `length` (and `transform_descriptors`, torch 2.7+)."""

    relative_path: str
    offset: int
    length: int


class TensorProperties(PickledRecord):
    """`dtype`, `layout`, `requires_grad`, `memory_format`, `pin_memory`."""

    dtype: torch.dtype

    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == len(self.FIELDS):  # torch's __getstate__
            self.__dict__.update(zip(self.FIELDS, state, strict=True))
        else:
            super().__setstate__(state)


def _value(*args: Any) -> Any:
    return args[0] if args else None


def _size(*args: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in args[0]) if args else ()


def _path(*parts: Any) -> str:
    return str(pathlib.PurePath(*(str(p) for p in parts)))


# what each allowed name becomes when read as plain records (no torch class, no torch code)
_PLAIN: dict[str, Any] = {
    "Metadata": Metadata,
    "TensorStorageMetadata": TensorStorageMetadata,
    "ChunkStorageMetadata": ChunkStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata,
    "MetadataIndex": MetadataIndex,
    "StorageMeta": StorageMeta,
    "TensorProperties": TensorProperties,
    "_StorageInfo": StorageInfo,
    "_MEM_FORMAT_ENCODING": _value,
    "Size": _size,
    "_get_layout": _value,
    "OrderedDict": collections.OrderedDict,
    "PurePosixPath": _path,
    "PureWindowsPath": _path,
}

# where each allowed name lives today, for torch's own reader (--engine transformers)
_TORCH: dict[str, tuple[str, str]] = {
    **{n: (_DCP_METADATA, n) for n in _DCP_METADATA_NAMES},
    "_StorageInfo": (_DCP_FILESYSTEM, "_StorageInfo"),
    "Size": ("torch", "Size"),
    "_get_layout": ("torch.serialization", "_get_layout"),
    "OrderedDict": ("collections", "OrderedDict"),
    "PurePosixPath": ("pathlib", "PurePosixPath"),
    "PureWindowsPath": ("pathlib", "PureWindowsPath"),
}


def _torch_class(name: str) -> Any:
    import importlib

    module, attr = _TORCH[name]
    return getattr(importlib.import_module(module), attr)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str, as_torch: bool) -> None:
        super().__init__(file)
        self.source = source
        self.as_torch = as_torch

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPE_NAMES:
            return getattr(torch, name)
        target = _METADATA_CLASSES.get((module, name))
        if target is None:
            raise CheckpointError(
                f"{self.source}: refused to load: the pickle references {module}.{name}, which is "
                "not a checkpoint metadata class (the file may be malicious or not a DCP .metadata)"
            )
        if not self.as_torch:
            return _PLAIN[target]
        try:
            return _torch_class(target)
        except (ImportError, AttributeError):
            raise CheckpointError(
                f"{self.source}: {module}.{name} is not available in this torch version"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source}: unexpected persistent reference in metadata pickle")


def load_metadata_pickle(path: str | Path, as_torch: bool = False) -> Any:
    """Unpickle a DCP `.metadata` file through the allow-list; refuse anything else.

    By default the result is made of plain `PickledRecord`s (no torch class is instantiated,
    none of its code runs); ``as_torch=True`` gives torch's own classes, for torch's reader.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data), str(p), as_torch).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{p}: not a readable DCP .metadata file ({type(exc).__name__}: {exc})"
        ) from None


# -- chunk records -------------------------------------------------------------------------------

# legacy typed-storage class names that torch.save writes -> element dtype
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class StoredTensor:
    """What a chunk record's data.pkl says about its tensor (nothing is loaded)."""

    storage_key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


def _record_rebuild(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any
) -> StoredTensor:
    if not isinstance(storage, _StorageRef):
        raise CheckpointError("tensor record does not reference a storage")
    return StoredTensor(
        storage.key,
        storage.dtype,
        storage.numel,
        int(storage_offset),
        tuple(int(s) for s in size),
        tuple(int(s) for s in stride),
    )


class UnsupportedRecord(Exception):
    """The record is valid for torch but not a plain tensor this parser understands."""


class _RecordUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _record_rebuild
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise UnsupportedRecord(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsupportedRecord(f"persistent id {pid!r}")
        stype = pid[1]
        if not isinstance(stype, _StorageType):
            raise UnsupportedRecord(f"storage type {stype!r}")
        return _StorageRef(str(pid[2]), stype.dtype, int(pid[4]))


def parse_tensor_record(data_pkl: bytes) -> StoredTensor:
    """Describe the tensor pickled in a torch.save record's data.pkl without loading it.

    Raises `UnsupportedRecord` for anything other than a plain dense tensor (the caller then
    falls back to ``torch.load(weights_only=True)``).
    """
    try:
        out = _RecordUnpickler(io.BytesIO(data_pkl)).load()
    except UnsupportedRecord:
        raise
    except CheckpointError as exc:
        raise UnsupportedRecord(str(exc)) from None
    except Exception as exc:
        raise UnsupportedRecord(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(out, StoredTensor):
        raise UnsupportedRecord(f"record holds {type(out).__name__}, not a tensor")
    return out
