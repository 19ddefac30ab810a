"""Find a chunk's raw tensor bytes inside its stored record and read them.

DCP stores every chunk as a standalone ``torch.save`` zip archive at (offset, length) in a
``.distcp`` file, with its records stored uncompressed. `parse_record` checks the archive with
the one zip-record locator (`shardforge.io.zip_record`: every member inside the chunk's byte
range and the file) and parses its ``data.pkl`` through the allow-list parser; `check_record`
then checks the tensor view against its storage member and the chunk's `.metadata` entry and
gives the absolute file offset of the tensor's elements, so the bytes can be copied or read in
place without unpickling anything. Parsing is per byte range, checking per entry: a cache of
parsed records (`io.copy.ReadCache`) never skips an entry's own check.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import Chunk
from shardforge.formats.dcp.pickles import (
    VALUES,
    StoredTensor,
    UnsupportedRecord,
    parse_tensor_record,
)
from shardforge.io.dtypes import DtypeName, resolve_dtype
from shardforge.io.files import read_exact_into
from shardforge.io.unpickler import unpickle
from shardforge.io.zip_record import (
    ZipMember,
    ZipRecord,
    check_crc,
    check_view,
    read_member,
    read_zip_record,
)

if TYPE_CHECKING:
    import torch

# a chunk record's data.pkl describes one tensor in a few hundred bytes
MAX_RECORD_PICKLE = 1 << 20


@dataclass(frozen=True)
class RawChunk:
    """Where a chunk's elements are in its data file, in the stored memory layout."""

    file: Path
    data_offset: int  # absolute file offset of the chunk's first element
    dtype: torch.dtype  # a `DtypeName` when read before torch is imported (io.dtypes)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_numel: int  # elements of the storage from `data_offset` on
    storage: ZipMember  # the storage's zip member (its bytes and stored CRC-32)

    @property
    def contiguous(self) -> bool:
        expected: list[int] = []
        acc = 1
        for s in reversed(self.size):
            expected.insert(0, acc)
            acc *= s
        return math.prod(self.size) <= 1 or all(
            st == ex for st, ex, sz in zip(self.stride, expected, self.size, strict=True) if sz != 1
        )

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize


@dataclass(frozen=True)
class ParsedRecord:
    """A chunk record as stored, before it is matched with a `.metadata` entry."""

    record: ZipRecord
    tensor: StoredTensor | None  # None: not a plain little-endian tensor (torch.load reads it)
    storage: ZipMember | None

    def resolved(self) -> ParsedRecord:
        """This record with torch's dtype where it was parsed before torch's import."""
        if self.tensor is None or not isinstance(self.tensor.dtype, DtypeName):
            return self
        return replace(self, tensor=replace(self.tensor, dtype=resolve_dtype(self.tensor.dtype)))


def parse_record(file: Path, fd: int, byte_offset: int, byte_length: int) -> ParsedRecord:
    """Check the zip record at (`byte_offset`, `byte_length`) of `file` and parse its tensor."""
    record = read_zip_record(fd, byte_offset, byte_length, str(file))
    pkl = _data_pkl(record)
    root = pkl[: -len("data.pkl")]
    data_pkl = read_member(fd, record, record.members[pkl], MAX_RECORD_PICKLE)
    order = record.members.get(f"{root}byteorder")
    if order is not None and read_member(fd, record, order, 16) != b"little":
        return ParsedRecord(record, None, None)
    try:
        stored: StoredTensor = parse_tensor_record(data_pkl, f"{file} (record at {byte_offset})")
    except UnsupportedRecord:
        return ParsedRecord(record, None, None)
    return ParsedRecord(record, stored, record.member(f"{root}data/{stored.storage_key}"))


def _data_pkl(record: ZipRecord) -> str:
    pkl = [n for n in record.members if n == "data.pkl" or n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise record.error("has no single data.pkl member (not a torch.save record)")
    return pkl[0]


def check_record_crcs(fd: int, record: ZipRecord, label: str) -> None:
    """Every member of `record` against the CRC-32 torch stored for it (one block in memory)."""
    for member in record.members.values():
        check_crc(fd, member, label)


def read_value(file: Path, fd: int, byte_offset: int, byte_length: int) -> object:
    """A non-tensor DCP entry (a `torch.save`d number, string, tuple, list or dict) read
    through the allow-list: plain values only, no class and no persistent id."""
    record = read_zip_record(fd, byte_offset, byte_length, str(file))
    data_pkl = read_member(fd, record, record.members[_data_pkl(record)], MAX_RECORD_PICKLE)
    return unpickle(data_pkl, f"{file} (record at {byte_offset})", VALUES)


def check_record(chunk: Chunk, parsed: ParsedRecord) -> RawChunk | None:
    """`parsed` checked against `chunk`'s `.metadata` entry: where its elements are, or None
    when the record is not a plain tensor this parser understands."""
    stored, member = parsed.tensor, parsed.storage
    if stored is None or member is None:
        return None
    itemsize = stored.dtype.itemsize
    check_view(
        str(chunk.file),
        chunk.byte_offset,
        stored.storage_offset,
        stored.size,
        stored.stride,
        stored.storage_numel,
        itemsize,
        member.size,
    )
    if stored.size != chunk.sizes:
        raise CheckpointError(
            f"{chunk.file}: record at byte {chunk.byte_offset} holds shape "
            f"{list(stored.size)[:8]}, .metadata says {list(chunk.sizes)[:8]}; corrupt checkpoint"
        )
    return RawChunk(
        chunk.file,
        member.data_offset + stored.storage_offset * itemsize,
        stored.dtype,
        stored.size,
        stored.stride,
        stored.storage_numel - stored.storage_offset,
        member,
    )


def locate(chunk: Chunk, fd: int) -> RawChunk | None:
    """Parse and check a chunk's record; None when it is not a plain tensor this parser
    understands (`read_chunk` then loads it with ``torch.load(weights_only=True)``)."""
    return check_record(chunk, parse_record(chunk.file, fd, chunk.byte_offset, chunk.byte_length))


def read_chunk(chunk: Chunk, fd: int, raw: RawChunk | None) -> torch.Tensor:
    """Load one chunk as a tensor (only this chunk's bytes are read)."""
    import torch

    label = str(chunk.file)
    if raw is not None:
        if raw.contiguous:
            n = raw.nbytes
            if not n:
                return torch.empty(raw.size, dtype=raw.dtype)
            buf = bytearray(n)
            read_exact_into(fd, buf, raw.data_offset, label)
            return torch.frombuffer(buf, dtype=raw.dtype).view(raw.size)
        span = 1 + sum((n - 1) * s for n, s in zip(raw.size, raw.stride, strict=True))
        buf = bytearray(span * raw.dtype.itemsize)  # check_view: inside the storage
        read_exact_into(fd, buf, raw.data_offset, label)
        storage = torch.frombuffer(buf, dtype=raw.dtype)
        return torch.as_strided(storage, raw.size, raw.stride).contiguous()
    data = bytearray(chunk.byte_length)
    read_exact_into(fd, data, chunk.byte_offset, label)
    try:
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise CheckpointError(
            f"{chunk.file}: cannot read the record at byte {chunk.byte_offset} ({reason})"
        ) from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != chunk.sizes:
        raise CheckpointError(f"{chunk.file}: record at byte {chunk.byte_offset} is not the tensor")
    return t.contiguous()
