"""Fill the planned safetensors files from the checkpoint's chunks, one tensor at a time.

A chunk that is a contiguous slab along dim 0 lands in one contiguous byte range of the
output: without a cast it is copied file-to-file (`copy_file_range`, no bytes through Python);
with a cast only that chunk is read and converted. Other chunk shapes assemble one tensor in
memory. Peak memory is therefore about one tensor, whatever the model size.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shardforge.formats.dcp.metadata import Chunk, TensorEntry
from shardforge.formats.dcp.records import (
    ParsedRecord,
    RawChunk,
    check_record,
    parse_record,
    read_chunk,
)
from shardforge.io.copy import FileSlab
from shardforge.io.dtypes import dtype_name
from shardforge.io.files import open_regular, read_exact_into

if TYPE_CHECKING:
    import torch

MAX_OPEN_FILES = 64

Progress = Callable[[int], None]


class ChunkReader:
    """Reads chunks of a checkpoint's data files, keeping a few file descriptors open.

    Data files are opened as regular files only (`shardforge.io.files.open_regular`: a FIFO or
    a device is refused, never waited on). Each record is parsed once per byte range and
    checked against every `.metadata` entry that names it.
    """

    def __init__(self) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._parsed: dict[tuple[Path, int, int], ParsedRecord] = {}

    def fd(self, path: Path) -> int:
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        fd = open_regular(path)
        self._fds[path] = fd
        return fd

    def locate(self, chunk: Chunk) -> tuple[int, RawChunk | None]:
        fd = self.fd(chunk.file)
        key = (chunk.file, chunk.byte_offset, chunk.byte_length)
        parsed = self._parsed.get(key)
        if parsed is None:
            parsed = parse_record(chunk.file, fd, chunk.byte_offset, chunk.byte_length)
            self._parsed[key] = parsed
        return fd, check_record(chunk, parsed)

    def read(self, chunk: Chunk) -> torch.Tensor:
        fd, raw = self.locate(chunk)
        return read_chunk(chunk, fd, raw)

    def read_rows(self, chunk: Chunk, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (along dim 0) of a chunk; only those bytes are read when the
        chunk is stored contiguously."""
        import torch

        fd, raw = self.locate(chunk)
        if raw is None or not raw.contiguous or not chunk.sizes:
            return read_chunk(chunk, fd, raw)[start:stop]
        row = math.prod(chunk.sizes[1:]) * raw.dtype.itemsize
        n = (stop - start) * row
        buf = bytearray(n)
        read_exact_into(fd, buf, raw.data_offset + start * row, str(chunk.file))
        flat = torch.frombuffer(buf, dtype=raw.dtype) if n else torch.empty(0, dtype=raw.dtype)
        return flat.view((stop - start, *chunk.sizes[1:]))

    def read_full(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor, assembled from its chunks."""
        import torch

        if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
            return self.read(entry.chunks[0])
        full = torch.empty(entry.shape, dtype=entry.dtype)
        for c in entry.chunks:
            if c.numel:
                full[chunk_slices(c)] = self.read(c)
        return full

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def entry_slabs(entry: TensorEntry, reader: ChunkReader) -> list[FileSlab] | None:
    """The tensor's bytes as file ranges, when every stored chunk is a contiguous slab along
    dim 0 in the entry's dtype (each then copies file to file); else None. Dtypes compare by
    name: the head start's records may be read on either side of `import torch`."""
    shape = entry.shape
    row = math.prod(shape[1:]) * entry.dtype.itemsize
    out = []
    for c in entry.chunks:
        if not c.numel:
            continue
        if shape and (any(c.offsets[1:]) or c.sizes[1:] != shape[1:]):
            return None
        _, raw = reader.locate(c)
        if raw is None or not raw.contiguous or dtype_name(raw.dtype) != dtype_name(entry.dtype):
            return None
        dst = c.offsets[0] * row if shape else 0
        out.append(FileSlab(c.file, raw.data_offset, raw.nbytes, dst))
    return out


def check_records(tensors: Iterable[TensorEntry]) -> None:
    """Every chunk record of `tensors` located and checked against its `.metadata` entry
    (zip structure inside its byte range, tensor view inside its storage, shape) without
    reading tensor bytes: what resume checks before it trusts a checkpoint."""
    with ChunkReader() as reader:
        for entry in tensors:
            for chunk in entry.chunks:
                reader.locate(chunk)


def chunk_slices(c: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
