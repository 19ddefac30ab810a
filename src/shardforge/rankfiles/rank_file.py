"""Read one per-rank ``model_world_size_W_rank_R.pt`` file without unpickling arbitrary code.

The file is a ``torch.save`` zip (records stored uncompressed): ``<root>/data.pkl`` (the state
dict, parsed by `rank_unpickler`), ``<root>/byteorder`` and one ``<root>/data/<key>`` record
per storage. `read_rank_file` turns it into plain per-key records that say where each local
shard's bytes are in the file; `read_local` reads just those bytes.
"""

from __future__ import annotations

import math
import os
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError
from shardforge.rankfiles.rank_unpickler import (
    DTensorRecord,
    LocalTensor,
    Placement,
    load_rank_pickle,
)

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")

# a state dict's pickle holds a few hundred bytes per tensor; anything this large is not one
MAX_PICKLE_BYTES = 1 << 30

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


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


def parse_rank_name(path: Path) -> tuple[int, int] | None:
    """(world_size, rank) from ``model_world_size_W_rank_R.pt``; None for other names."""
    m = RANK_FILE.match(path.name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _member_data_offset(fh: object, info: zipfile.ZipInfo, path: Path) -> int:
    fd = fh.fileno()  # type: ignore[attr-defined]
    header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
    if len(header) != _LOCAL_HEADER.size:
        raise CheckpointError(f"{path}: truncated zip record {info.filename}")
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_MAGIC:
        raise CheckpointError(f"{path}: damaged zip record {info.filename}")
    return int(info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10])


def read_rank_file(path: str | Path) -> RankFile:
    """Parse a rank file's zip directory and data.pkl; CheckpointError on anything unexpected."""
    p = Path(path)
    names = parse_rank_name(p)
    if names is None:
        raise CheckpointError(f"{p}: not named model_world_size_<W>_rank_<R>.pt")
    world_size, rank = names
    if rank >= world_size:
        raise CheckpointError(f"{p}: rank {rank} is not below world size {world_size}")
    try:
        with p.open("rb") as fh, zipfile.ZipFile(fh) as zf:
            infos = zf.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1:
                raise CheckpointError(f"{p}: not a torch.save file (no single data.pkl record)")
            if pkl[0].file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(
                    f"{p}: data.pkl is {pkl[0].file_size} bytes; not a state dict of tensors"
                )
            root = pkl[0].filename[: -len("data.pkl")]
            by_name = {i.filename: i for i in infos}
            order = by_name.get(f"{root}byteorder")
            if order is not None and zf.read(order) != b"little":
                raise CheckpointError(f"{p}: written on a big-endian machine; not supported")
            entries = load_rank_pickle(zf.read(pkl[0]), str(p))
            size = p.stat().st_size
            tensors = {}
            for key, entry in entries.items():
                local = entry.local if isinstance(entry, DTensorRecord) else entry
                member = f"{root}data/{local.storage.key}"
                info = by_name.get(member)
                if info is None:
                    raise CheckpointError(f"{p}: entry {key!r} references missing record {member}")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{p}: record {member} is compressed; not supported")
                offset = _member_data_offset(fh, info, p)
                if offset + info.file_size > size:
                    raise CheckpointError(f"{p}: truncated (record {member} ends past the file)")
                tensors[key] = _record(key, p, entry, local, member, offset, info.file_size)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise CheckpointError(
            f"{p}: not a readable torch.save zip ({exc}); the file is damaged or truncated"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    return RankFile(p, world_size, rank, tensors)


def _record(
    key: str,
    path: Path,
    entry: LocalTensor | DTensorRecord,
    local: LocalTensor,
    member: str,
    offset: int,
    member_size: int,
) -> TensorRecord:
    if isinstance(entry, DTensorRecord):
        if entry.dtype != local.storage.dtype:
            raise CheckpointError(f"{path}: entry {key!r}: DTensor and local dtypes differ")
        dtensor = (entry.global_shape, entry.placements, entry.mesh_shape, entry.coordinate)
    else:
        dtensor = (local.size, (), None, None)
    global_shape, placements, mesh_shape, coordinate = dtensor
    if len(local.size) != len(local.stride) or len(local.size) != len(global_shape):
        raise CheckpointError(f"{path}: entry {key!r}: inconsistent shape and stride")
    if any(n < 0 for n in local.size) or local.storage_offset < 0:
        raise CheckpointError(f"{path}: entry {key!r}: negative size or offset")
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
        member=member,
        data_offset=offset,
        member_size=member_size,
    )
    itemsize = rec.dtype.itemsize
    if (rec.storage_offset + rec.span) * itemsize > member_size or any(s < 0 for s in rec.stride):
        raise CheckpointError(
            f"{path}: entry {key!r}: view reaches past its storage record {member}"
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
            if os.preadv(fd, [view], start) != nbytes:
                raise CheckpointError(f"{rec.path}: short read of {rec.key!r}; file truncated?")
        return target
    nbytes = rec.span * itemsize
    buf = bytearray(nbytes)
    if os.preadv(fd, [buf], start) != nbytes:
        raise CheckpointError(f"{rec.path}: short read of {rec.key!r}; file truncated?")
    flat = torch.frombuffer(buf, dtype=rec.dtype)
    strided = torch.as_strided(flat, rec.local_shape, rec.stride)
    if out is not None:
        return out.copy_(strided)
    return strided.contiguous()
