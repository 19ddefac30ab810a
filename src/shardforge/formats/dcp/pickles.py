"""The pickles of a DCP checkpoint, each with its allow-list profile (`shardforge.io.unpickler`).

* `METADATA`: a DCP ``.metadata`` file. `load_metadata_pickle` gives plain `Record`s; with
  ``as_torch=True`` (torch's own reader: resume, ``--engine transformers``) those records are
  then converted to torch's dataclasses by calling their constructors with checked fields, so
  no torch object is ever built by the pickle itself.
* `TENSOR_RECORD`: the ``data.pkl`` of one chunk's ``torch.save`` record:
  `parse_tensor_record` describes the tensor without loading it.
* `VALUES`: the ``data.pkl`` of a non-tensor entry's record (optimizer settings and the like).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardforge.errors import CheckpointError
from shardforge.formats.torchsave import TENSOR_GLOBALS, LocalTensor, storage_ref
from shardforge.io.files import open_regular
from shardforge.io.unpickler import (
    Opaque,
    Problem,
    Profile,
    ints,
    ordered_dict,
    record_class,
    sanitize,
    size_text,
    torch_size,
    unpickle,
)

if TYPE_CHECKING:
    import torch

# a .metadata holds ~200 bytes per chunk: 32 MiB is over 160,000 chunks (a model of 900
# tensors with its optimizer state, saved by 64 ranks, needs 11 MB); at this cap the allow-list
# unpickler reads or refuses any file within seconds and under 1 GB (`io.unpickler`)
METADATA_MAX_BYTES = 32 << 20
TENSOR_RECORD_MAX_BYTES = 1 << 20  # one tensor's data.pkl is a few hundred bytes

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.metadata"  # torch 2.2

# DCP metadata, read as plain records (torch's classes of the same names; see `to_torch_metadata`)
Metadata = record_class(
    "Metadata", __name__, "`state_dict_metadata`, `planner_data`, `storage_data` (and more)."
)
TensorStorageMetadata = record_class(
    "TensorStorageMetadata", __name__, "`properties`, `size`, `chunks`."
)
ChunkStorageMetadata = record_class("ChunkStorageMetadata", __name__, "`offsets`, `sizes`.")
BytesStorageMetadata = record_class("BytesStorageMetadata", __name__, "A non-tensor entry.")
MetadataIndex = record_class("MetadataIndex", __name__, "`fqn`, `offset`, `index`.")
StorageMeta = record_class("StorageMeta", __name__, "Save ids (torch 2.4+).")
StorageInfo = record_class(
    "StorageInfo", __name__, "`relative_path`, `offset`, `length` (`transform_descriptors`)."
)
TensorProperties = record_class(
    "TensorProperties",
    __name__,
    "`dtype`, `layout`, `requires_grad`, `memory_format` (an encoding), `pin_memory`.",
    ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
)


def _value(*args: Any) -> Any:
    return args[0] if args else None


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise Problem("has a path made of something other than strings (damaged)")
    return str(pathlib.PurePath(*parts))


METADATA = Profile(
    what="DCP .metadata files",
    globals={
        **{
            (_DCP_METADATA, cls.__name__): cls
            for cls in (
                Metadata,
                TensorStorageMetadata,
                ChunkStorageMetadata,
                BytesStorageMetadata,
                MetadataIndex,
                StorageMeta,
                TensorProperties,
            )
        },
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _value,
        (_DCP_FILESYSTEM, "_StorageInfo"): StorageInfo,
        (_SHARDED_TENSOR, "TensorProperties"): TensorProperties,
        (_SHARDED_TENSOR, "MEM_FORMAT_ENCODING"): _value,
        ("torch", "Size"): torch_size,
        ("torch.serialization", "_get_layout"): _value,
        ("collections", "OrderedDict"): ordered_dict,
        ("pathlib", "PosixPath"): _path,
        ("pathlib", "PurePosixPath"): _path,
        ("pathlib", "WindowsPath"): _path,
        ("pathlib", "PureWindowsPath"): _path,
    },
    max_bytes=METADATA_MAX_BYTES,
    max_memo=1 << 22,  # 32 MB of memo, whatever the file (real ones: one entry per 10 bytes)
)


VALUES = Profile(
    what="DCP non-tensor entries (optimizer settings and the like)",
    globals={("collections", "OrderedDict"): ordered_dict},
    max_bytes=TENSOR_RECORD_MAX_BYTES,
    max_memo=1 << 16,
)
"""Plain values torch.save stores for a DCP state dict's non-tensor entries (numbers, strings,
tuples, lists, dicts): no class, no persistent id."""


def load_metadata_pickle(path: str | Path, as_torch: bool = False) -> Any:
    """Unpickle a DCP `.metadata` file through the allow-list; refuse anything else.

    By default the result is made of plain `Record`s (no torch class is instantiated, none of
    its code runs); ``as_torch=True`` converts them to torch's own classes, for torch's reader.
    """
    p = Path(path)
    fd = open_regular(p)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > METADATA_MAX_BYTES:
            raise CheckpointError(
                f"{p}: refused to load: it is {size} bytes; {METADATA.what} are at most "
                f"{size_text(METADATA_MAX_BYTES)}"
            )
        try:
            data = f.read(size)
        except OSError as exc:
            raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    raw = unpickle(data, str(p), METADATA)
    return to_torch_metadata(raw, str(p)) if as_torch else raw


# -- torch's Metadata from the plain records -----------------------------------------------------


@functools.cache
def _memory_formats() -> tuple[Any, ...]:
    import torch

    return (torch.contiguous_format, torch.channels_last, torch.preserve_format)


@functools.cache
def _layouts() -> dict[str, Any]:
    import torch

    return {f"torch.{n}": v for n in dir(torch) if isinstance(v := getattr(torch, n), torch.layout)}


def to_torch_metadata(raw: Any, source: str) -> Any:
    """torch's ``Metadata`` built from plain records: each of torch's dataclasses is made by
    its constructor from fields checked here (so the pickle sets nothing on any torch class)."""
    try:
        return _torch_metadata(raw)
    except Problem as exc:
        raise CheckpointError(f"{source}: malformed DCP metadata: {exc}") from None
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise CheckpointError(
            f"{source}: malformed DCP metadata ({type(exc).__name__}: {sanitize(str(exc))})"
        ) from None


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is not None and not isinstance(value, kind):
        raise Problem(f"{what} is a {sanitize(value)}, not a {kind.__name__}")
    return value


@functools.cache
def _init_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.init)


def _fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `values` that `cls` (a dataclass) takes in this torch."""
    names = _init_names(cls)
    return {k: v for k, v in values.items() if k in names and v is not None}


def _plain_data(value: Any) -> Any:
    """Planner data: strings, numbers and containers of them (nesting is bounded already)."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif not (v is None or isinstance(v, (str, int, float, bool))):
            raise Problem(f"planner data holds a {sanitize(v)}")
    return value


def _torch_properties(props: Any) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties as TorchProperties

    if not isinstance(props, TensorProperties):
        raise Problem("a tensor entry has no TensorProperties")
    dtype = props.get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise Problem("a tensor entry has no dtype")
    layout = props.get("layout", "torch.strided")
    layout = _layouts().get(layout) if isinstance(layout, str) else None
    if layout is None:
        raise Problem("a tensor entry has an unknown layout")
    fmt = props.get("memory_format", 0)
    if type(fmt) is not int or not 0 <= fmt < len(_memory_formats()):
        raise Problem("a tensor entry has an unknown memory format")
    return TorchProperties(
        dtype=dtype,
        layout=layout,
        requires_grad=bool(props.get("requires_grad", False)),
        memory_format=_memory_formats()[fmt],
        pin_memory=bool(props.get("pin_memory", False)),
    )


def _torch_entry(key: Any, item: Any) -> Any:
    """One `state_dict_metadata` entry as torch's Bytes- or TensorStorageMetadata."""
    import torch
    from torch.distributed.checkpoint import metadata as m

    if not isinstance(key, str):
        raise Problem("a state-dict key is not a string")
    if isinstance(item, BytesStorageMetadata):
        return m.BytesStorageMetadata()
    if not isinstance(item, TensorStorageMetadata):
        raise Problem(f"entry {sanitize(key)!r} is a {sanitize(item)}")
    chunks = item.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        raise Problem(f"entry {sanitize(key)!r} has no list of chunks")
    return m.TensorStorageMetadata(
        properties=_torch_properties(item.get("properties")),
        size=torch.Size(ints(item.get("size"), "size")),
        chunks=[
            m.ChunkStorageMetadata(
                offsets=torch.Size(ints(c.get("offsets"), "chunk offset")),
                sizes=torch.Size(ints(c.get("sizes"), "chunk size")),
            )
            for c in chunks
        ],
    )


def _torch_storage_item(index: Any, info: Any) -> tuple[Any, Any]:
    """One `storage_data` item as torch's (MetadataIndex, _StorageInfo)."""
    import torch
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(index, MetadataIndex) or not isinstance(info, StorageInfo):
        raise Problem("storage_data holds something other than storage records")
    offset = index.get("offset")
    key = m.MetadataIndex(
        fqn=_opt(index.get("fqn"), str, "a storage key"),
        offset=None if offset is None else torch.Size(ints(offset, "storage offset")),
        index=_opt(index.get("index"), int, "a storage index"),
    )
    transforms = info.get("transform_descriptors")
    if transforms is not None and not (
        isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)
    ):
        raise Problem("transform descriptors are not strings")
    values = {
        "relative_path": _opt(info.get("relative_path"), str, "a relative path"),
        "offset": ints((info.get("offset"),), "storage offset")[0],
        "length": ints((info.get("length"),), "storage length")[0],
        "transform_descriptors": transforms,
    }
    return key, _StorageInfo(**_fields(_StorageInfo, values))


def _torch_storage(storage: Any) -> dict[Any, Any] | None:
    if storage is None:
        return None
    if not isinstance(storage, dict):
        raise Problem("storage_data is not a dict")
    return dict(_torch_storage_item(index, info) for index, info in storage.items())


def _torch_storage_meta(meta: Any) -> Any:
    from torch.distributed.checkpoint import metadata as m

    if not isinstance(meta, StorageMeta):
        raise Problem("storage_meta is not a StorageMeta")
    modules = meta.get("modules") or []
    if not isinstance(modules, list) or not all(isinstance(x, str) for x in modules):
        raise Problem("storage_meta.modules is not a list of strings")
    values = {
        "checkpoint_id": _opt(meta.get("checkpoint_id"), str, "the checkpoint id"),
        "save_id": _opt(meta.get("save_id"), str, "the save id"),
        "load_id": _opt(meta.get("load_id"), str, "the load id"),
        "modules": modules,
    }
    return m.StorageMeta(**_fields(m.StorageMeta, values))


def _torch_metadata(raw: Any) -> Any:
    from torch.distributed.checkpoint import metadata as m

    if not isinstance(raw, Metadata):
        raise Problem(f"it holds a {sanitize(raw)}, not DCP Metadata")
    sd_meta = raw.get("state_dict_metadata")
    if not isinstance(sd_meta, dict):
        raise Problem("no state_dict_metadata")
    entries = {key: _torch_entry(key, item) for key, item in sd_meta.items()}
    fields: dict[str, Any] = {
        "state_dict_metadata": entries,
        "storage_data": _torch_storage(raw.get("storage_data")),
        "planner_data": _plain_data(raw.get("planner_data")),
        "version": _opt(raw.get("version"), str, "the version"),
    }
    meta = raw.get("storage_meta")
    if meta is not None:
        fields["storage_meta"] = _torch_storage_meta(meta)
    return m.Metadata(**_fields(m.Metadata, fields))


# -- chunk records -------------------------------------------------------------------------------


class UnsupportedRecord(Exception):
    """The record is valid for torch but not a plain tensor this parser understands (the
    caller then falls back to ``torch.load(weights_only=True)``)."""


@dataclass(frozen=True)
class StoredTensor:
    """What a chunk record's data.pkl says about its tensor (nothing is loaded)."""

    storage_key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _opaque_torch(module: str, name: str) -> Any:
    """Other torch names (rebuild functions of tensor kinds not modelled here) stand for
    themselves; anything outside torch is refused."""
    if module == "torch" or module.startswith("torch."):
        return Opaque(f"{module}.{name}", named=True)
    return None


TENSOR_RECORD = Profile(
    what="torch.save tensor records",
    globals=TENSOR_GLOBALS,
    max_bytes=TENSOR_RECORD_MAX_BYTES,
    max_memo=1 << 12,
    persistent=storage_ref,
    other_global=_opaque_torch,
)


def parse_tensor_record(data_pkl: bytes, source: str = "data.pkl") -> StoredTensor:
    """Describe the tensor pickled in a torch.save record's data.pkl without loading it.

    A hostile or damaged pickle is a CheckpointError; a valid one that is not a plain dense
    tensor of a legacy storage type raises `UnsupportedRecord` (the whole pickle has then been
    checked by this parser, and the caller may hand the record to torch's weights-only loader).
    """
    out = unpickle(data_pkl, source, TENSOR_RECORD)
    if not isinstance(out, LocalTensor):
        raise UnsupportedRecord(f"record holds {sanitize(out)}, not a plain tensor")
    ref = out.storage
    return StoredTensor(ref.key, ref.dtype, ref.numel, out.storage_offset, out.size, out.stride)
