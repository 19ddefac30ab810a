"""What every ``torch.save`` pickle shares, for the profiles of the allow-list unpickler.

A ``torch.save`` file (a per-rank DTensor file, a DCP chunk record, Lightning's ``meta.pt``)
is a zip whose ``data.pkl`` names each tensor's storage by a persistent id
``('storage', <storage type>, key, location, numel)``; the storage's bytes are the zip member
``data/<key>``. `storage_ref` reads such an id (`STORAGE_TYPES`: the storage-type globals it
names) and `rebuild_tensor` stands for ``torch._utils._rebuild_tensor_v2``: a tensor becomes a
`LocalTensor` (which storage, and the view into it), and nothing is loaded. Dtypes without a
legacy typed storage (float8, uint16/32/64, ...) are saved as an ``UntypedStorage`` of bytes
and ``torch._utils._rebuild_tensor_v3``, which names the dtype: `rebuild_tensor_v3` gives the
same `LocalTensor`, its storage counted in elements of that dtype. `read_data_pkl` gives the
one ``data.pkl`` of a file through the checked zip locator.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardforge.errors import CheckpointError
from shardforge.io.dtypes import STORAGE_CLASSES, is_dtype, lookup_dtype
from shardforge.io.files import open_regular
from shardforge.io.unpickler import (
    Opaque,
    Problem,
    describe,
    ints,
    ordered_dict,
    refused,
    sanitize,
)
from shardforge.io.zip_record import read_member, read_zip_record

if TYPE_CHECKING:
    import torch

_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_]{1,64}$")


@dataclass(frozen=True)
class StorageRef:
    """A persistent reference to one storage record (``data/<key>`` in the zip)."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class LocalTensor:
    """A plain tensor's description: which storage, and the view into it."""

    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _StorageType:
    dtype: str  # its name (`lookup_dtype`)


# the legacy typed-storage globals (torch.FloatStorage, ...) a storage reference names, and the
# untyped storage (bytes) of the dtypes that have none
STORAGE_TYPES = {("torch", cls): _StorageType(row.name) for cls, row in STORAGE_CLASSES.items()}
UNTYPED_STORAGE = _StorageType("uint8")


def storage_ref(pid: Any) -> Any:
    """A `Profile.persistent`: ``('storage', <storage type>, key, location, numel)``, as
    torch.save writes it, as a `StorageRef` (a storage type the profile leaves `Opaque` stays
    so)."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise refused("holds a persistent id that is not a storage reference")
    stype, key, numel = pid[1], pid[2], pid[4]
    if isinstance(stype, Opaque):
        return stype
    if not isinstance(stype, _StorageType):
        raise refused(f"names a {describe(stype)} as a storage type")
    if not isinstance(key, str) or not _STORAGE_KEY.match(key):
        raise Problem(f"has a malformed storage key {sanitize(key)!r}")
    if type(numel) is not int or numel < 0:
        raise Problem(f"has a malformed size for storage {key!r}")
    return StorageRef(key, lookup_dtype(stype.dtype), numel)


def rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    hooks: Any = None,
    dtype: Any = None,
    *_: Any,
) -> Any:
    """``torch._utils._rebuild_tensor_v3``: an untyped storage (bytes) viewed as `dtype`."""
    if isinstance(storage, Opaque):
        return storage
    if not is_dtype(dtype):
        raise Problem("has a tensor record without its dtype (damaged)")
    if not isinstance(storage, StorageRef) or storage.dtype != lookup_dtype("uint8"):
        raise Problem("has a tensor that does not reference an untyped storage (damaged)")
    if storage.numel % dtype.itemsize:
        raise Problem(f"has storage {storage.key!r} of {storage.numel} bytes for {dtype}")
    typed = StorageRef(storage.key, dtype, storage.numel // dtype.itemsize)
    return rebuild_tensor(typed, storage_offset, size, stride)


def rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> Any:
    """``torch._utils._rebuild_tensor_v2``: the tensor's `LocalTensor` (an `Opaque` storage,
    one the profile does not model, stays opaque)."""
    if isinstance(storage, Opaque):
        return storage
    if not isinstance(storage, StorageRef):
        raise Problem("has a tensor that does not reference a storage (damaged)")
    offset = ints((storage_offset,), "storage offset")[0]
    return LocalTensor(storage, offset, ints(size, "size"), ints(stride, "stride"))


# what a torch.save pickle of plain tensors names: every torch.save profile lists these
TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): ordered_dict,
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): rebuild_tensor_v3,
    ("torch.storage", "UntypedStorage"): UNTYPED_STORAGE,
    **STORAGE_TYPES,
}


def read_data_pkl(path: Path, max_bytes: int) -> bytes:
    """The ``data.pkl`` of the torch.save file `path` (a regular file inside its folder), its
    zip structure checked and the member CRC-checked; refused past `max_bytes`."""
    fd = open_regular(path, path.parent)
    try:
        zipped = read_zip_record(fd, 0, os.fstat(fd).st_size, str(path))
        pkl = [n for n in zipped.members if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: not a torch.save file (no single data.pkl record)")
        return read_member(fd, zipped, zipped.members[pkl[0]], max_bytes)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
