"""Fill the planned safetensors files from the checkpoint's chunks, one tensor at a time.

A chunk that is a contiguous slab along dim 0 lands in one contiguous byte range of the
output: without a cast it is copied file-to-file (`copy_file_range`, no bytes through Python);
with a cast only that chunk is read and converted. Other chunk shapes assemble one tensor in
memory. Peak memory is therefore about one tensor, whatever the model size.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from shardforge.checkpoint.chunk_record import RawChunk, locate, read_chunk
from shardforge.checkpoint.fastio import CopyJob, copy_jobs
from shardforge.checkpoint.metadata import Chunk, TensorEntry
from shardforge.checkpoint.plan import SAFE_WEIGHTS_INDEX_NAME, OutputPlan, PlannedTensor
from shardforge.errors import CheckpointError

COPY_BLOCK = 64 << 20
MAX_OPEN_FILES = 64

Progress = Callable[[int], None]


class ChunkReader:
    """Reads chunks of a checkpoint's data files, keeping a few file descriptors open."""

    def __init__(self) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._raw: dict[tuple[Path, int], RawChunk | None] = {}  # parsed records

    def fd(self, path: Path) -> int:
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open ({exc.strerror})") from None
        self._fds[path] = fd
        return fd

    def locate(self, chunk: Chunk) -> tuple[int, RawChunk | None]:
        fd = self.fd(chunk.file)
        key = (chunk.file, chunk.byte_offset)
        if key not in self._raw:
            self._raw[key] = locate(chunk, fd)
        return fd, self._raw[key]

    def read(self, chunk: Chunk) -> torch.Tensor:
        fd, raw = self.locate(chunk)
        return read_chunk(chunk, fd, raw)

    def read_rows(self, chunk: Chunk, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (along dim 0) of a chunk; only those bytes are read when the
        chunk is stored contiguously."""
        fd, raw = self.locate(chunk)
        if raw is None or not raw.contiguous or not chunk.sizes:
            return read_chunk(chunk, fd, raw)[start:stop]
        row = math.prod(chunk.sizes[1:]) * raw.dtype.itemsize
        n = (stop - start) * row
        buf = bytearray(n)
        if n and os.preadv(fd, [buf], raw.data_offset + start * row) != n:
            raise CheckpointError(f"{chunk.file}: short read at byte {raw.data_offset}")
        flat = torch.frombuffer(buf, dtype=raw.dtype) if n else torch.empty(0, dtype=raw.dtype)
        return flat.view((stop - start, *chunk.sizes[1:]))

    def read_full(self, entry: TensorEntry) -> torch.Tensor:
        """The whole tensor, assembled from its chunks."""
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


def chunk_slices(c: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))


def _is_slab(c: Chunk, shape: tuple[int, ...]) -> bool:
    return len(shape) == 0 or (all(o == 0 for o in c.offsets[1:]) and c.sizes[1:] == shape[1:])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order (little-endian on the supported platforms)."""
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = data.cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src: int, dst: int, src_off: int, dst_off: int, count: int) -> None:
    """Copy bytes file to file, in the kernel where possible."""
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, min(count, COPY_BLOCK), src_off, dst_off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = 0
        if n == 0:  # unsupported here (or EOF): copy through a bounded buffer
            data = os.pread(src, min(count, COPY_BLOCK), src_off)
            if not data:
                raise CheckpointError("unexpected end of a data file while copying")
            pwrite_all(dst, memoryview(data), dst_off)
            n = len(data)
        src_off, dst_off, count = src_off + n, dst_off + n, count - n


def fill_tensor(
    reader: ChunkReader, out_fd: int, planned: PlannedTensor, entry: TensorEntry, progress: Progress
) -> None:
    """Write one output tensor from its chunks at its planned place."""
    out_dtype = planned.spec.dtype
    shape = entry.shape
    chunks = [c for c in entry.chunks if c.numel]
    if all(_is_slab(c, shape) for c in chunks):
        row = math.prod(shape[1:]) * out_dtype.itemsize
        for c in chunks:
            dst = planned.offset + (c.offsets[0] * row if shape else 0)
            fd, raw = reader.locate(c)
            if raw is not None and raw.contiguous and raw.dtype == out_dtype:
                copy_range(fd, out_fd, raw.data_offset, dst, raw.nbytes)
            else:
                pwrite_all(out_fd, tensor_bytes(read_chunk(c, fd, raw).to(out_dtype)), dst)
            progress(c.numel * out_dtype.itemsize)
        return
    full = reader.read_full(entry).to(out_dtype)
    pwrite_all(out_fd, tensor_bytes(full), planned.offset)
    progress(full.numel() * out_dtype.itemsize)


def _preallocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        os.ftruncate(fd, size)


def write_plan(
    plan: OutputPlan,
    sources: Mapping[str, Any],
    directory: Path,
    progress: Progress,
) -> None:
    """Create every planned file (and the index when sharded) in `directory`; fsync them.

    `sources` maps each output name to its `checkpoint.sources.TensorSource` (a bare DCP
    `TensorEntry` is accepted too)."""
    from shardforge.checkpoint.sources import DcpSource, write_source

    with ChunkReader() as reader:
        for pf in plan.files:
            fd = os.open(directory / pf.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _preallocate(fd, pf.size)
                pwrite_all(fd, memoryview(pf.header), 0)
                progress(len(pf.header))
                # Tensors stored as they are written (no cast, slabs along dim 0) are copied
                # file to file by a few threads at once; the others go through memory, one
                # tensor (or one chunk) at a time.
                jobs: list[CopyJob] = []
                through_memory = []
                for planned in pf.tensors:
                    src = sources[planned.spec.name]
                    if isinstance(src, TensorEntry):
                        src = DcpSource(src)
                    same = src.dtype == planned.spec.dtype
                    slabs = src.slabs(reader) if same else None
                    if slabs is None:
                        through_memory.append((planned, src))
                        continue
                    jobs += [
                        CopyJob(s.path, s.src_offset, fd, planned.offset + s.dst_offset, s.nbytes)
                        for s in slabs
                    ]
                copy_jobs(jobs, copy_range, progress)
                for planned, src in through_memory:
                    write_source(reader, fd, planned.offset, planned.spec.dtype, src, progress)
                os.fsync(fd)
            finally:
                os.close(fd)
    if plan.index is not None:
        text = json.dumps(plan.index, indent=2, sort_keys=True) + "\n"
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(text, encoding="utf-8")
