"""A tensor of a DCP checkpoint as a `TensorSource`: stored in chunks, written chunk by chunk
(slabs along dim 0 copied file to file, or cast in bounded blocks on a few threads), compared
block by block. Memory: one chunk, or one cast block per thread."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.formats.base import Described, Destination, Progress, Rows, StoredTensor
from shardforge.formats.dcp.chunks import (
    entry_slabs,
    locate,
    read_full,
    read_rows,
)
from shardforge.formats.dcp.metadata import Chunk, TensorEntry
from shardforge.formats.dcp.records import RawChunk
from shardforge.formats.sources import row_bytes, write_rows_whole
from shardforge.io.copy import FileSlab, ReadCache, copy_range, pwrite_all, tensor_bytes
from shardforge.io.files import read_exact_into

# the name of this format (`formats.dcp.format.DcpFormat.name`; torch-free there)
DCP = "dcp"


@dataclass(frozen=True)
class DcpSource(Described):
    """A tensor of a DCP checkpoint, stored in chunks."""

    entry: TensorEntry
    directory: Path | None = None  # the DCP directory (default: its first data file's folder)
    fmt: str = DCP  # the registry row whose reference reader reads it (`StoredTensor.fmt`)

    @property
    def described(self) -> TensorEntry:
        return self.entry

    @property
    def path(self) -> tuple[str, ...]:
        return self.entry.path

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return entry_slabs(self.entry, reader)

    def read(self, reader: ReadCache) -> torch.Tensor:
        return read_full(reader, self.entry)

    def stored(self) -> tuple[StoredTensor, ...]:
        chunks = self.entry.chunks
        directory = self.directory or (chunks[0].file.parent if chunks else Path("."))
        return (StoredTensor(self.fmt, directory, self.entry.key, self.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]

    def write(self, reader: ReadCache, dest: Destination, rows: Rows | None = None) -> None:
        """Chunk by chunk: a slab along dim 0 lands in its own byte range (copied file to file
        without a cast, else converted in blocks; only the rows asked for are read); other
        chunk shapes assemble the tensor."""
        if self.shape and self._slabs_only():
            self._write_slab_rows(reader, dest, rows or (0, self.shape[0]))
        elif rows is not None:
            write_rows_whole(self, reader, dest, rows)
        else:
            full = read_full(reader, self.entry).to(dest.dtype)
            pwrite_all(dest.fd, tensor_bytes(full), dest.offset)
            dest.progress(full.numel() * dest.dtype.itemsize)

    def _slabs_only(self) -> bool:
        return all(_is_slab(c, self.shape) for c in self.entry.chunks if c.numel)

    def _write_slab_rows(self, reader: ReadCache, dest: Destination, rows: Rows) -> None:
        """Rows [start, stop) of a tensor stored as slabs along dim 0, at their byte range:
        copied file to file without a cast, converted in blocks (`cast_slab`) with one, read
        through the record otherwise (a stored layout that is not contiguous)."""
        out_fd, out_dtype, progress = dest.fd, dest.dtype, dest.progress
        row = row_bytes(self.shape, out_dtype)
        for c in self.entry.chunks:
            lo, hi = max(rows[0], c.offsets[0]), min(rows[1], c.offsets[0] + c.sizes[0])
            if not c.numel or lo >= hi:
                continue
            first, last, dst = lo - c.offsets[0], hi - c.offsets[0], dest.offset + lo * row
            fd, raw = locate(reader, c)
            if raw is not None and raw.contiguous and raw.dtype == out_dtype:
                copy_range(fd, out_fd, raw.data_offset + first * row, dst, (hi - lo) * row)
                progress((hi - lo) * row)
            elif raw is not None and raw.contiguous:
                cast_slab(fd, raw, out_fd, dst, out_dtype, progress, rows=(first, last))
            else:
                part = read_rows(reader, c, first, last).to(out_dtype)
                pwrite_all(out_fd, tensor_bytes(part.contiguous()), dst)
                progress((hi - lo) * row)


# a cast goes through memory in blocks of about this many input bytes, several at a time
CAST_BLOCK = 4 << 20
CAST_THREADS = max(1, min(4, os.cpu_count() or 1))
_cast_pool: ThreadPoolExecutor | None = None


class _Scratch(threading.local):
    """Each cast thread's input and output buffers, kept and reused block after block.

    Allocating fresh blocks (16 MB then) instead cost the cast merge about 230 MB of RSS at 4 GB:
    once glibc has freed a block that large, it raises its mmap threshold and keeps later
    blocks in each thread's arena. Reused, a thread holds one block of each."""

    def __init__(self) -> None:
        self.inp = bytearray()
        self.out = torch.empty(0, dtype=torch.uint8)

    def take(self, n_in: int, n_out: int) -> tuple[memoryview, torch.Tensor]:
        if len(self.inp) < n_in:
            self.inp = bytearray(n_in)
        if self.out.numel() < n_out:
            self.out = torch.empty(n_out, dtype=torch.uint8)
        return memoryview(self.inp)[:n_in], self.out[:n_out]


_scratch = _Scratch()


def _pool() -> ThreadPoolExecutor:
    global _cast_pool
    if _cast_pool is None:
        _cast_pool = ThreadPoolExecutor(CAST_THREADS, thread_name_prefix="shardforge-cast")
    return _cast_pool


def cast_slab(
    fd: int,
    raw: RawChunk,
    out_fd: int,
    dst: int,
    out_dtype: torch.dtype,
    progress: Progress,
    block_bytes: int | None = None,
    rows: tuple[int, int] | None = None,
) -> None:
    """Rows [start, stop) (default: all) of a contiguous stored chunk, cast to `out_dtype`, at
    byte `dst` of `out_fd`: row blocks read, converted and written by `CAST_THREADS` threads
    (reads, the conversion and writes release the GIL). Memory: one block per thread, reused
    (`_Scratch`)."""
    first, last = rows if rows is not None else (0, raw.size[0])
    row_in = max(1, math.prod(raw.size[1:]) * raw.dtype.itemsize)
    row_out = math.prod(raw.size[1:]) * out_dtype.itemsize
    step = max(1, (block_bytes or CAST_BLOCK) // row_in)
    label = str(raw.file)

    def one(start: int) -> int:
        n = min(last, start + step) - start
        inp, out = _scratch.take(n * row_in, n * row_out)
        if not out.numel():
            return 0
        read_exact_into(fd, inp, raw.data_offset + start * row_in, label)
        out.view(out_dtype).copy_(torch.frombuffer(inp, dtype=raw.dtype))
        pwrite_all(out_fd, tensor_bytes(out), dst + (start - first) * row_out)
        return out.numel()

    for written in _pool().map(one, range(first, last, step)):
        progress(written)


def _is_slab(c: Chunk, shape: tuple[int, ...]) -> bool:
    return len(shape) == 0 or (all(o == 0 for o in c.offsets[1:]) and c.sizes[1:] == shape[1:])
