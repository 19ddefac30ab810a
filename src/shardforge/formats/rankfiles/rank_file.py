"""Read one per-rank ``model_world_size_W_rank_R.pt`` file without unpickling arbitrary code.

The file is a ``torch.save`` zip (records stored uncompressed): ``<root>/data.pkl`` (the state
dict, parsed by `formats.rankfiles.pickles`), ``<root>/byteorder`` and one ``<root>/data/<key>`` record
per storage. `read_rank_file` turns it into plain per-key records that say where each local
shard's bytes are in the file; `read_local` reads just those bytes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.rankfiles.names import parse_rank_name
from shardforge.formats.rankfiles.pickles import (
    DTensorRecord,
    LocalTensor,
    Placement,
    load_rank_pickle,
)
from shardforge.io.files import open_regular, read_exact_into
from shardforge.io.zip_record import ZipMember, check_view, read_member, read_zip_record

# a state dict's pickle holds a few hundred bytes per tensor; anything this large is not one
MAX_PICKLE_BYTES = 1 << 30


@dataclass(frozen=True)
class TensorRecord:
    """One state-dict entry of one rank file: global metadata and where the local bytes are."""

    key: str
    path: Path
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    placements: tuple[Placement, ...]  # empty for a plain (non-DTensor) tensor
    mesh_shape: tuple[int, ...] | None
    coordinate: tuple[int, ...] | None  # this rank's position on each mesh dimension
    local_shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements, into the storage record
    member: str  # zip member holding the storage
    data_offset: int  # absolute byte offset of the storage record's first byte in the file
    member_size: int  # bytes in the storage record
    storage: ZipMember  # that member (its bytes and stored CRC-32)
    # a DTensor's shard order when its spec names one (`pickles.DTensorRecord.shard_order`)
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    mesh_rank: int | None = None  # the global rank its mesh says saved it

    @property
    def is_dtensor(self) -> bool:
        return bool(self.placements)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def span(self) -> int:
        """Elements of the storage the local view touches, from `storage_offset` on."""
        if self.local_numel == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.local_shape, self.stride, strict=True))

    @property
    def contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.local_shape), reversed(self.stride), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


@dataclass(frozen=True)
class RankFile:
    """A parsed rank file: its world size, rank and per-key records (nothing loaded)."""

    path: Path
    world_size: int
    rank: int
    tensors: dict[str, TensorRecord]


def read_rank_file(path: str | Path, position: tuple[int, int] | None = None) -> RankFile:
    """Parse a rank file's zip directory and data.pkl; CheckpointError on anything unexpected.
    `position` is its (world size, rank) where its name does not say (default: parsed from
    ``model_world_size_W_rank_R.pt``)."""
    p = Path(path)
    names = position or parse_rank_name(p)
    if names is None:
        raise CheckpointError(f"{p}: not named model_world_size_<W>_rank_<R>.pt")
    world_size, rank = names
    if rank >= world_size:
        raise CheckpointError(f"{p}: rank {rank} is not below world size {world_size}")
    fd = open_regular(p, p.parent)  # a regular file, not a link out of its folder
    try:
        zipped = read_zip_record(fd, 0, os.fstat(fd).st_size, str(p))
        pkl = [n for n in zipped.members if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise CheckpointError(f"{p}: not a torch.save file (no single data.pkl record)")
        root = pkl[0][: -len("data.pkl")]
        data_pkl = read_member(fd, zipped, zipped.members[pkl[0]], MAX_PICKLE_BYTES)
        order = zipped.members.get(f"{root}byteorder")
        if order is not None and read_member(fd, zipped, order, 16) != b"little":
            raise CheckpointError(f"{p}: written on a big-endian machine; not supported")
        entries = load_rank_pickle(data_pkl, str(p))
        tensors = {}
        for key, entry in entries.items():
            local = entry.local if isinstance(entry, DTensorRecord) else entry
            member = zipped.members.get(f"{root}data/{local.storage.key}")
            if member is None:
                raise CheckpointError(
                    f"{p}: entry {key!r} references missing record data/{local.storage.key}"
                )
            tensors[key] = _record(key, p, entry, local, member)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    return RankFile(p, world_size, rank, tensors)


def _record(
    key: str,
    path: Path,
    entry: LocalTensor | DTensorRecord,
    local: LocalTensor,
    member: ZipMember,
) -> TensorRecord:
    if isinstance(entry, DTensorRecord):
        if entry.dtype != local.storage.dtype:
            raise CheckpointError(f"{path}: entry {key!r}: DTensor and local dtypes differ")
        dtensor = (entry.global_shape, entry.placements, entry.mesh_shape, entry.coordinate)
        order, mesh_rank = entry.shard_order, entry.mesh_rank
    else:
        dtensor = (local.size, (), None, None)
        order, mesh_rank = None, None
    global_shape, placements, mesh_shape, coordinate = dtensor
    if len(local.size) != len(local.stride) or len(local.size) != len(global_shape):
        raise CheckpointError(f"{path}: entry {key!r}: inconsistent shape and stride")
    check_view(
        f"{path}: entry {key!r}",
        member.header_offset,
        local.storage_offset,
        local.size,
        local.stride,
        local.storage.numel,
        local.storage.dtype.itemsize,
        member.size,
    )
    rec = TensorRecord(
        key=key,
        path=path,
        dtype=local.storage.dtype,
        global_shape=global_shape,
        placements=placements,
        mesh_shape=mesh_shape,
        coordinate=coordinate,
        local_shape=local.size,
        stride=local.stride,
        storage_offset=local.storage_offset,
        member=member.name,
        data_offset=member.data_offset,
        member_size=member.size,
        storage=member,
        shard_order=order,
        mesh_rank=mesh_rank,
    )
    return rec


def read_local(fd: int, rec: TensorRecord, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read `rec`'s local tensor from open file `fd` (only its own bytes).

    With `out` (a contiguous tensor of the local shape and dtype) a contiguous record is read
    straight into it.
    """
    itemsize = rec.dtype.itemsize
    start = rec.data_offset + rec.storage_offset * itemsize
    if rec.contiguous:
        nbytes = rec.local_numel * itemsize
        target = out if out is not None else torch.empty(rec.local_shape, dtype=rec.dtype)
        if nbytes:
            view = memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            read_exact_into(fd, view, start, str(rec.path))
        return target
    buf = bytearray(rec.span * itemsize)
    read_exact_into(fd, buf, start, str(rec.path))
    flat = torch.frombuffer(buf, dtype=rec.dtype)
    strided = torch.as_strided(flat, rec.local_shape, rec.stride)
    if out is not None:
        return out.copy_(strided)
    return strided.contiguous()
