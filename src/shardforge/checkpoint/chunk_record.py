"""Find a chunk's raw tensor bytes inside its stored record and read them.

DCP stores every chunk as a standalone ``torch.save`` zip archive at (offset, length) in a
``.distcp`` file, with its records stored uncompressed. Parsing the zip directory and the
record's ``data.pkl`` (through the allow-list parser) gives the absolute file offset of the
tensor's storage, so the bytes can be copied or read in place without unpickling anything.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.checkpoint.metadata import Chunk
from shardforge.checkpoint.safe_pickle import StoredTensor, UnsupportedRecord, parse_tensor_record
from shardforge.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


class _Window(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buf), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class RawChunk:
    """Where a chunk's elements are in its data file, in the stored memory layout."""

    file: Path
    data_offset: int  # absolute file offset of the chunk's first element
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_numel: int

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


def _member_data_offset(fd: int, start: int, info: zipfile.ZipInfo) -> int:
    header = os.pread(fd, _LOCAL_HEADER.size, start + info.header_offset)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_MAGIC:
        raise CheckpointError("bad zip local header")
    name_len, extra_len = fields[9], fields[10]
    return start + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def locate(chunk: Chunk, fd: int) -> RawChunk | None:
    """Parse a chunk's record; None when it is not a plain tensor this parser understands."""
    window = _Window(fd, chunk.byte_offset, chunk.byte_length)
    try:
        with zipfile.ZipFile(io.BufferedReader(window)) as zf:
            infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
            pkl = infos.get("data.pkl")
            if pkl is None:
                raise CheckpointError("no data.pkl record")
            if infos.get("byteorder") is not None and zf.read(infos["byteorder"]) != b"little":
                return None
            stored: StoredTensor = parse_tensor_record(zf.read(pkl))
            member = infos.get(f"data/{stored.storage_key}")
            if member is None or member.compress_type != zipfile.ZIP_STORED:
                return None
            base = _member_data_offset(fd, chunk.byte_offset, member)
            if member.file_size < stored.storage_numel * stored.dtype.itemsize:
                raise CheckpointError("storage record shorter than its tensor")
    except UnsupportedRecord:
        return None
    except (zipfile.BadZipFile, CheckpointError, ValueError, KeyError, struct.error) as exc:
        raise CheckpointError(
            f"{chunk.file}: the record at byte {chunk.byte_offset} is damaged ({exc}); the "
            "checkpoint is corrupt or truncated"
        ) from None
    if stored.size != chunk.sizes:
        raise CheckpointError(
            f"{chunk.file}: record at byte {chunk.byte_offset} holds shape {stored.size}, "
            f".metadata says {chunk.sizes}"
        )
    return RawChunk(
        chunk.file,
        base + stored.storage_offset * stored.dtype.itemsize,
        stored.dtype,
        stored.size,
        stored.stride,
        stored.storage_numel - stored.storage_offset,
    )


def read_chunk(chunk: Chunk, fd: int, raw: RawChunk | None) -> torch.Tensor:
    """Load one chunk as a tensor (only this chunk's bytes are read)."""
    if raw is not None:
        if raw.contiguous:
            n = raw.nbytes
            buf = bytearray(n)
            if n and os.preadv(fd, [buf], raw.data_offset) != n:
                raise CheckpointError(f"{chunk.file}: short read at byte {raw.data_offset}")
            flat = torch.frombuffer(buf, dtype=raw.dtype) if n else torch.empty(0, dtype=raw.dtype)
            return flat.view(raw.size)
        span = raw.storage_numel * raw.dtype.itemsize
        buf = bytearray(span)
        os.preadv(fd, [buf], raw.data_offset)
        storage = torch.frombuffer(buf, dtype=raw.dtype)
        return torch.as_strided(storage, raw.size, raw.stride).contiguous()
    data = os.pread(fd, chunk.byte_length, chunk.byte_offset)
    if len(data) != chunk.byte_length:
        raise CheckpointError(f"{chunk.file}: truncated at byte {chunk.byte_offset}")
    try:
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{chunk.file}: cannot read the record at byte {chunk.byte_offset} ({exc})"
        ) from None
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != chunk.sizes:
        raise CheckpointError(f"{chunk.file}: record at byte {chunk.byte_offset} is not the tensor")
    return t.contiguous()
