"""A DCP reader for resume whose `.metadata` unpickler accepts only DCP's own record classes.

`torch.distributed.checkpoint.FileSystemReader` reads `.metadata` with plain `pickle.load`, which
runs whatever the file names. Resume reads it through an allow-list instead, so a tampered
checkpoint fails with a CheckpointError rather than executing code. (Tensor data and the byte
items of the optimizer state are already read by torch with `weights_only=True`.)
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from shardforge.errors import CheckpointError

METADATA_FILE = ".metadata"

# (module, name) -> object: everything a DCP `.metadata` pickle may reference
ALLOWED: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
        if hasattr(dcp_metadata, name)
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    # storage_meta.checkpoint_id may be a path: rebuilt as a pure path (no file system access)
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    **{
        ("torch", name): getattr(torch, name)
        for name in dir(torch)
        if isinstance(getattr(torch, name, None), torch.dtype)
    },
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here") from None


def read_dcp_metadata(directory: str | Path) -> Any:
    """The Metadata of a DCP directory, unpickled through the allow-list."""
    path = Path(directory) / METADATA_FILE
    try:
        with path.open("rb") as f:
            metadata = _AllowListUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: not a DCP metadata file this reader accepts ({exc})"
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_dcp_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
