"""What one output tensor is filled from: a `TensorSource`.

Every kind of input (a DCP entry, a tensor spread over per-rank DTensor files, a tensor that
must be reordered, the mean of several checkpoints' tensors) is a source with a shape, a dtype
and two ways to be read:

* `slabs(reader)`: byte ranges of input files that, copied in order, are the tensor's C-order
  bytes (zero-copy with `copy_file_range`), or None when the tensor must go through memory;
* `read(reader)`: the whole tensor (in `dtype`, or float32 for an average);

and two ways to be used: `write_into` (the tensor, cast, at a planned byte range of an output
file) and `blocks` (the tensor in row blocks, for comparisons). A DCP entry does both chunk by
chunk (memory: one chunk); the others through one whole tensor. Writers never ask which kind of
source they have.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from shardforge.errors import MergeError
from shardforge.formats.dcp.chunks import ChunkReader, chunk_slices, entry_slabs
from shardforge.formats.dcp.metadata import Chunk, TensorEntry
from shardforge.formats.dcp.records import RawChunk
from shardforge.io.copy import FileSlab, copy_range, pwrite_all, tensor_bytes
from shardforge.io.files import read_exact_into

Progress = Callable[[int], None]
Index = tuple[slice, ...]


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as its checkpoint stores it, named for a reader other than ours (verification
    reads it through torch): the format (`DCP_FORMAT`, `RANK_FILES_FORMAT`), the checkpoint
    folder, the key there, dtype and shape."""

    fmt: str
    directory: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


DCP_FORMAT = "dcp"
RANK_FILES_FORMAT = "rankfiles"
# a safetensors file (`StoredTensor.directory` is the file itself)
SAFETENSORS_FORMAT = "safetensors"


@runtime_checkable
class TensorSource(Protocol):
    """One full tensor of some input."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None: ...

    def read(self, reader: ChunkReader) -> torch.Tensor: ...

    def stored(self) -> tuple[StoredTensor, ...]:
        """The stored tensors this one is made of (for verification's independent read)."""
        ...

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """This tensor (as `read` returns it) from its `stored()` tensors, read elsewhere."""
        ...

    def write_into(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        progress: Progress,
    ) -> None: ...

    def blocks(
        self, reader: ChunkReader, dtype: torch.dtype, block_bytes: int
    ) -> Iterator[tuple[Index, torch.Tensor]]: ...

    def write_rows(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        rows: tuple[int, int],
        progress: Progress,
    ) -> None:
        """Rows [start, stop) along dim 0 of the tensor (all of a 0-d one), cast, at their
        place in the tensor written at byte `offset` (one rank's share of a distributed
        merge)."""
        ...


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize


def _write_rows_whole(
    source: TensorSource,
    reader: ChunkReader,
    out_fd: int,
    offset: int,
    out_dtype: torch.dtype,
    rows: tuple[int, int],
    progress: Progress,
) -> None:
    """`write_rows` through one whole tensor in memory (sources without row access)."""
    start, stop = rows
    full = source.read(reader).to(out_dtype)
    part = full[start:stop] if source.shape else full
    data = tensor_bytes(part.contiguous())
    pwrite_all(out_fd, data, offset + start * _row_bytes(source.shape, out_dtype))
    progress(data.nbytes)


def _write_whole(
    source: TensorSource,
    reader: ChunkReader,
    out_fd: int,
    offset: int,
    out_dtype: torch.dtype,
    progress: Progress,
) -> None:
    """Write a source's tensor, cast to `out_dtype`, at byte `offset` of `out_fd`: its slabs
    file to file when it has them, else through memory (one tensor)."""
    slabs = source.slabs(reader) if source.dtype == out_dtype else None
    if slabs is not None:
        for s in slabs:
            copy_range(reader.fd(s.path), out_fd, s.src_offset, offset + s.dst_offset, s.nbytes)
            progress(s.nbytes)
        return
    data = tensor_bytes(source.read(reader).to(out_dtype))
    pwrite_all(out_fd, data, offset)
    progress(data.nbytes)


def _blocks_whole(
    source: TensorSource, reader: ChunkReader, dtype: torch.dtype, block_bytes: int
) -> Iterator[tuple[Index, torch.Tensor]]:
    """The whole tensor read once (one tensor in memory), yielded in row blocks."""
    full = source.read(reader).to(dtype)
    shape = source.shape
    if not shape:
        yield (), full
        return
    row_bytes = max(1, math.prod(shape[1:]) * dtype.itemsize)
    step = max(1, block_bytes // row_bytes)
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        yield _rows(shape, start, stop), full[start:stop]


class _WholeTensor:
    """`write_into` and `blocks` through `slabs` / `read` (every source but a DCP entry)."""

    def write_into(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        progress: Progress,
    ) -> None:
        _write_whole(self, reader, out_fd, offset, out_dtype, progress)  # type: ignore[arg-type]

    def blocks(
        self, reader: ChunkReader, dtype: torch.dtype, block_bytes: int
    ) -> Iterator[tuple[Index, torch.Tensor]]:
        return _blocks_whole(self, reader, dtype, block_bytes)  # type: ignore[arg-type]

    def write_rows(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        rows: tuple[int, int],
        progress: Progress,
    ) -> None:
        _write_rows_whole(self, reader, out_fd, offset, out_dtype, rows, progress)  # type: ignore[arg-type]


def _rows(shape: tuple[int, ...], start: int, stop: int) -> Index:
    return (slice(start, stop), *(slice(0, n) for n in shape[1:])) if shape else ()


@dataclass(frozen=True)
class DcpSource:
    """A tensor of a DCP checkpoint, stored in chunks."""

    entry: TensorEntry
    directory: Path | None = None  # the DCP directory (default: its first data file's folder)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def path(self) -> tuple[str, ...]:
        return self.entry.path

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None:
        return entry_slabs(self.entry, reader)

    def read(self, reader: ChunkReader) -> torch.Tensor:
        return reader.read_full(self.entry)

    def stored(self) -> tuple[StoredTensor, ...]:
        chunks = self.entry.chunks
        directory = self.directory or (chunks[0].file.parent if chunks else Path("."))
        return (StoredTensor(DCP_FORMAT, directory, self.entry.key, self.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]

    def write_into(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        progress: Progress,
    ) -> None:
        """Chunk by chunk: a slab along dim 0 lands in its own byte range (copied file to file
        without a cast, else converted in blocks); other chunk shapes assemble the tensor."""
        if self.shape and self._slabs_only():
            self._write_slab_rows(reader, out_fd, offset, out_dtype, (0, self.shape[0]), progress)
            return
        full = reader.read_full(self.entry).to(out_dtype)
        pwrite_all(out_fd, tensor_bytes(full), offset)
        progress(full.numel() * out_dtype.itemsize)

    def write_rows(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        rows: tuple[int, int],
        progress: Progress,
    ) -> None:
        """Only the rows' bytes of the slab chunks they cross are read (or copied file to file
        without a cast); other chunk shapes go through the whole tensor."""
        if not self.shape or not self._slabs_only():
            _write_rows_whole(self, reader, out_fd, offset, out_dtype, rows, progress)
            return
        self._write_slab_rows(reader, out_fd, offset, out_dtype, rows, progress)

    def _slabs_only(self) -> bool:
        return all(_is_slab(c, self.shape) for c in self.entry.chunks if c.numel)

    def _write_slab_rows(
        self,
        reader: ChunkReader,
        out_fd: int,
        offset: int,
        out_dtype: torch.dtype,
        rows: tuple[int, int],
        progress: Progress,
    ) -> None:
        """Rows [start, stop) of a tensor stored as slabs along dim 0, at their byte range:
        copied file to file without a cast, converted in blocks (`cast_slab`) with one, read
        through the record otherwise (a stored layout that is not contiguous)."""
        row = _row_bytes(self.shape, out_dtype)
        for c in self.entry.chunks:
            lo, hi = max(rows[0], c.offsets[0]), min(rows[1], c.offsets[0] + c.sizes[0])
            if not c.numel or lo >= hi:
                continue
            first, last, dst = lo - c.offsets[0], hi - c.offsets[0], offset + lo * row
            fd, raw = reader.locate(c)
            if raw is not None and raw.contiguous and raw.dtype == out_dtype:
                copy_range(fd, out_fd, raw.data_offset + first * row, dst, (hi - lo) * row)
                progress((hi - lo) * row)
            elif raw is not None and raw.contiguous:
                cast_slab(fd, raw, out_fd, dst, out_dtype, progress, rows=(first, last))
            else:
                part = reader.read_rows(c, first, last).to(out_dtype)
                pwrite_all(out_fd, tensor_bytes(part.contiguous()), dst)
                progress((hi - lo) * row)

    def blocks(
        self, reader: ChunkReader, dtype: torch.dtype, block_bytes: int
    ) -> Iterator[tuple[Index, torch.Tensor]]:
        """Chunk by chunk, in row blocks of about `block_bytes` (memory: one block)."""
        for chunk in self.entry.chunks:
            if chunk.numel:
                yield from _chunk_blocks(reader, chunk, dtype, block_bytes)


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


@dataclass(frozen=True)
class RankFileSource(_WholeTensor):
    """A tensor assembled from per-rank DTensor files (`shardforge.formats.rankfiles.TensorPlan`)."""

    plan: Any  # rankfiles.TensorPlan (imported lazily: the DCP path never loads rankfiles)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.plan.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.dtype

    @property
    def path(self) -> tuple[str, ...]:
        return (self.plan.key,)

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None:
        slabs = self.plan.slabs()
        if slabs is None:
            return None
        return [FileSlab(s.path, s.src_offset, s.nbytes, s.dst_offset) for s in slabs]

    def read(self, reader: ChunkReader) -> torch.Tensor:
        from shardforge.formats.rankfiles.rank_file import read_local

        tp = self.plan
        out = torch.empty(tp.shape, dtype=tp.dtype)
        for piece in tp.pieces:
            rec = piece.record
            region = out
            for dim, (start, size) in enumerate(zip(piece.offsets, piece.sizes, strict=True)):
                if size != tp.shape[dim]:
                    region = region.narrow(dim, start, size)
            if region.is_contiguous():
                read_local(reader.fd(rec.path), rec, out=region)
            else:
                region.copy_(read_local(reader.fd(rec.path), rec))
        return out

    def stored(self) -> tuple[StoredTensor, ...]:
        tp = self.plan
        directory = tp.pieces[0].record.path.parent
        return (StoredTensor(RANK_FILES_FORMAT, directory, tp.key, tp.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]


@dataclass(frozen=True)
class TransformedSource(_WholeTensor):
    """Another source's tensor reordered by `transform` (e.g. torchtitan's RoPE q/k rows);
    never zero-copy."""

    inner: TensorSource
    transform: Callable[[torch.Tensor], torch.Tensor]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inner.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None:
        return None

    def read(self, reader: ChunkReader) -> torch.Tensor:
        return self.transform(self.inner.read(reader))

    def stored(self) -> tuple[StoredTensor, ...]:
        return self.inner.stored()

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.transform(self.inner.combine(tensors))


@dataclass(frozen=True)
class AveragedSource(_WholeTensor):
    """The element-wise mean of several sources of one name and shape.

    Floating tensors are summed in float32 one input at a time (memory: the accumulator plus
    one input tensor), divided by the count and returned in float32; the writer casts to the
    output dtype. Other dtypes (integer buffers) are taken from the first input.
    """

    inputs: tuple[TensorSource, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inputs[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inputs[0].dtype

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None:
        return None if self.dtype.is_floating_point else self.inputs[0].slabs(reader)

    def read(self, reader: ChunkReader) -> torch.Tensor:
        if not self.dtype.is_floating_point:
            return self.inputs[0].read(reader)
        acc = torch.zeros(self.shape, dtype=torch.float32)
        for src in self.inputs:
            acc += src.read(reader).to(torch.float32)
        return acc.div_(len(self.inputs))

    def stored(self) -> tuple[StoredTensor, ...]:
        return tuple(s for src in self.inputs for s in src.stored())

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """As `read`, from the inputs' stored tensors (in `stored()` order)."""
        parts, start = [], 0
        for src in self.inputs:
            n = len(src.stored())
            parts.append(src.combine(tensors[start : start + n]))
            start += n
        if not self.dtype.is_floating_point:
            return parts[0]
        acc = torch.zeros(self.shape, dtype=torch.float32)
        for part in parts:
            acc += part.to(torch.float32)
        return acc.div_(len(self.inputs))


# ---------------------------------------------------------------- LoRA (merge-lora, --merge_lora)


def fuse_lora(
    base: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    transpose: bool = False,
) -> torch.Tensor:
    """``W + scale * B @ A`` in float32, with peft's operations in peft's order
    (`LoraLayer.get_delta_weight` then ``weight += delta``): ``(B @ A)``, transposed for an
    embedding or a fan-in-fan-out layer, times the Python float `scale`, plus W. Each step is
    the same float32 operation as peft's, so a float32 model fuses bit for bit alike."""
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    if transpose:
        delta = delta.T
    delta = delta.mul_(scale)
    return delta.add_(base.to(torch.float32)).contiguous()  # W + d == d + W in IEEE arithmetic


@dataclass(frozen=True)
class FusedLoraSource(_WholeTensor):
    """A base weight with a LoRA adapter fused in: ``base + scale * lora_b @ lora_a``
    (`fuse_lora`), returned in float32 (the writer casts to the output dtype).

    `lora_a` is (r, in) and `lora_b` (out, r) for a linear layer; for an embedding
    (`transpose`) peft stores A as (r, num_embeddings) and B as (dim, r) and the delta is
    ``(B @ A).T``. Memory: the base tensor, the float32 delta it is added to, A and B.
    """

    base: TensorSource
    lora_a: TensorSource
    lora_b: TensorSource
    scale: float
    transpose: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def slabs(self, reader: ChunkReader) -> list[FileSlab] | None:
        return None

    def read(self, reader: ChunkReader) -> torch.Tensor:
        a, b = self.lora_a.read(reader), self.lora_b.read(reader)
        return fuse_lora(self.base.read(reader), a, b, self.scale, self.transpose)

    def stored(self) -> tuple[StoredTensor, ...]:
        return (*self.base.stored(), *self.lora_a.stored(), *self.lora_b.stored())

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """As `read`, from the stored tensors of base, A and B (in `stored()` order)."""
        parts, start = [], 0
        for src in (self.base, self.lora_a, self.lora_b):
            n = len(src.stored())
            parts.append(src.combine(tensors[start : start + n]))
            start += n
        base, a, b = parts
        return fuse_lora(base, a, b, self.scale, self.transpose)


def average(
    per_input: Sequence[Mapping[str, TensorSource]], labels: Sequence[str]
) -> dict[str, TensorSource]:
    """name -> AveragedSource over every input; MergeError listing every name, shape or dtype
    that differs between the inputs (all checked before anything is written)."""
    first = per_input[0]
    problems: list[str] = []
    for label, other in zip(labels[1:], per_input[1:], strict=True):
        missing = sorted(set(first) - set(other))
        extra = sorted(set(other) - set(first))
        if missing:
            problems.append(f"{label} lacks {', '.join(missing[:10])}")
        if extra:
            problems.append(f"{label} has extra {', '.join(extra[:10])}")
        for name in sorted(set(first) & set(other)):
            a, b = first[name], other[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(
                    f"{name}: {a.dtype} {list(a.shape)} in {labels[0]} vs {b.dtype} "
                    f"{list(b.shape)} in {label}"
                )
    if problems:
        raise MergeError(
            "cannot average checkpoints of different architectures: "
            + "; ".join(problems[:20])
            + (f" (+{len(problems) - 20} more)" if len(problems) > 20 else "")
        )
    return {name: AveragedSource(tuple(p[name] for p in per_input)) for name in first}


def _chunk_blocks(
    reader: ChunkReader, chunk: Chunk, dtype: torch.dtype, block_bytes: int
) -> Iterator[tuple[Index, torch.Tensor]]:
    rows = chunk.sizes[0] if chunk.sizes else 1
    row_bytes = max(1, math.prod(chunk.sizes[1:]) * dtype.itemsize)
    step = max(1, block_bytes // row_bytes)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        expected = reader.read_rows(chunk, start, stop).to(dtype)
        if not chunk.sizes:
            yield (), expected
            continue
        index = list(chunk_slices(chunk))
        o0 = chunk.offsets[0]
        index[0] = slice(o0 + start, o0 + stop)
        yield tuple(index), expected


__all__ = [
    "DCP_FORMAT",
    "RANK_FILES_FORMAT",
    "SAFETENSORS_FORMAT",
    "AveragedSource",
    "DcpSource",
    "FileSlab",
    "FusedLoraSource",
    "RankFileSource",
    "StoredTensor",
    "TensorSource",
    "TransformedSource",
    "average",
    "fuse_lora",
]
