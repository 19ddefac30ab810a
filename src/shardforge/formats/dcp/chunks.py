"""Reading a DCP tensor's chunks through a `ReadCache`: each chunk's record located (parsed once,
checked against its `.metadata` entry), read whole or by rows, or handed out as file slabs.

A chunk that is a contiguous slab along dim 0 is one contiguous byte range of the tensor:
`entry_slabs` gives those ranges for a file-to-file copy (no bytes through Python). Other chunk
shapes assemble the tensor in memory (`read_full`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shardforge.formats.dcp.metadata import Chunk, TensorEntry
from shardforge.formats.dcp.records import (
    RawChunk,
    check_record,
    parse_record,
    read_chunk,
)
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.dtypes import dtype_name
from shardforge.io.files import read_exact_into

if TYPE_CHECKING:
    import torch


def locate(reader: ReadCache, chunk: Chunk) -> tuple[int, RawChunk | None]:
    """The data file's descriptor and the chunk's record, checked against the chunk's
    `.metadata` entry (each record parsed once per byte range: `ReadCache.fact`)."""
    span = (chunk.byte_offset, chunk.byte_length)
    parsed = reader.fact(
        chunk.file, ("dcp-record", *span), lambda fd: parse_record(chunk.file, fd, *span)
    )
    return reader.fd(chunk.file), check_record(chunk, parsed)


def read(reader: ReadCache, chunk: Chunk) -> torch.Tensor:
    fd, raw = locate(reader, chunk)
    return read_chunk(chunk, fd, raw)


def read_rows(reader: ReadCache, chunk: Chunk, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) (along dim 0) of a chunk; only those bytes are read when the chunk
    is stored contiguously."""
    import torch

    fd, raw = locate(reader, chunk)
    if raw is None or not raw.contiguous or not chunk.sizes:
        return read_chunk(chunk, fd, raw)[start:stop]
    row = math.prod(chunk.sizes[1:]) * raw.dtype.itemsize
    n = (stop - start) * row
    buf = bytearray(n)
    read_exact_into(fd, buf, raw.data_offset + start * row, str(chunk.file))
    flat = torch.frombuffer(buf, dtype=raw.dtype) if n else torch.empty(0, dtype=raw.dtype)
    return flat.view((stop - start, *chunk.sizes[1:]))


def read_full(reader: ReadCache, entry: TensorEntry) -> torch.Tensor:
    """The whole tensor, assembled from its chunks."""
    import torch

    if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
        return read(reader, entry.chunks[0])
    full = torch.empty(entry.shape, dtype=entry.dtype)
    for c in entry.chunks:
        if c.numel:
            full[chunk_slices(c)] = read(reader, c)
    return full


def entry_slabs(entry: TensorEntry, reader: ReadCache) -> list[FileSlab] | None:
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
        _, raw = locate(reader, c)
        if raw is None or not raw.contiguous or dtype_name(raw.dtype) != dtype_name(entry.dtype):
            return None
        dst = c.offsets[0] * row if shape else 0
        out.append(FileSlab(c.file, raw.data_offset, raw.nbytes, dst))
    return out


def check_records(tensors: Iterable[TensorEntry]) -> None:
    """Every chunk record of `tensors` located and checked against its `.metadata` entry
    (zip structure inside its byte range, tensor view inside its storage, shape) without
    reading tensor bytes: what resume checks before it trusts a checkpoint."""
    with ReadCache() as reader:
        for entry in tensors:
            for chunk in entry.chunks:
                locate(reader, chunk)


def chunk_slices(c: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
