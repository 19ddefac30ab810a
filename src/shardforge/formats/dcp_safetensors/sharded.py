"""The per-rank files of DCP's safetensors storage, as chunks of full tensors.

    plan = plan_shards("step-10/sharded")      # name -> ShardedTensor; all checks first

Each ``shard-<S>-model-<K>-of-<N>.safetensors`` is a safetensors file (its header parsed and
checked by `formats.safetensors.reader`: dtypes, shapes, byte ranges inside the data section,
no overlap) whose ``__metadata__`` holds ``DCP_SHARDING_INFO``: a JSON object giving, for every
tensor of the file, the offsets of that chunk in the full tensor (``saved_offsets``). Nothing
records the full shape: as torch's own reader does, it is the end of the furthest chunk along
each dimension. Across the files:

* the shard numbers run 1 .. S without a gap and every file names the same N (one save);
* every tensor has the same dtype and number of dimensions in every file;
* the chunks of a tensor are disjoint and tile it exactly (`formats.dcp.metadata.check_tiling`).

A missing last shard file shrinks the inferred shapes; the merge's check against the model's
architecture then names the tensors whose shapes differ.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import CheckpointError, shown
from shardforge.formats.base import Sized, StoredTensor
from shardforge.formats.dcp.metadata import Chunk, check_tiling
from shardforge.formats.dcp_safetensors.names import DCP_SAFETENSORS, list_shards
from shardforge.formats.safetensors.reader import read_header_and_metadata
from shardforge.formats.sources import WholeTensor
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.files import open_regular, read_exact_into

SHARDING_INFO = "DCP_SHARDING_INFO"
VERSION_KEY = "DCP_VERSION"
SAVED_OFFSETS = "saved_offsets"
# the DCP safetensors versions read (torch 2.13 writes "1.0")
KNOWN_MAJOR = "1"


@dataclass(frozen=True)
class ShardedTensor(Sized):
    """One full tensor: its dtype, inferred shape and stored chunks (`Chunk.byte_offset` is
    the chunk's first byte in its file, `byte_length` its size)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def _offsets(path: Path, name: str, info: dict[str, Any], ndim: int) -> tuple[int, ...]:
    entry = info.get(name)
    offsets = entry.get(SAVED_OFFSETS) if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list)
        and len(offsets) == ndim
        and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        raise CheckpointError(
            f"{path}: {SHARDING_INFO} gives tensor {shown(name)} the offsets {shown(offsets)}, "
            f"not {ndim} non-negative integers; the file is damaged"
        )
    return tuple(offsets)


def _sharding_info(path: Path, meta: dict[str, str], names: list[str]) -> dict[str, Any]:
    text = meta.get(SHARDING_INFO)
    if text is None:
        raise CheckpointError(
            f"{path}: has no {SHARDING_INFO} in its header; not written by DCP's "
            "HuggingFaceStorageWriter(save_distributed=True)"
        )
    version = meta.get(VERSION_KEY, KNOWN_MAJOR)
    if version.split(".")[0] != KNOWN_MAJOR:
        raise CheckpointError(
            f"{path}: {VERSION_KEY} {shown(version)} is newer than this reader knows "
            f"({KNOWN_MAJOR}.x); upgrade shardforge"
        )
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict) or sorted(info) != sorted(names):
        raise CheckpointError(
            f"{path}: its {SHARDING_INFO} is not an object naming exactly the file's tensors; "
            "the file is damaged"
        )
    return info


def read_shard(path: Path, root: Path) -> list[tuple[str, torch.dtype, Chunk]]:
    """Every chunk of one shard file (header checked, nothing else read)."""
    fd = open_regular(path, root)
    try:
        tensors, meta = read_header_and_metadata(fd, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)
    info = _sharding_info(path, meta, list(tensors))
    out = []
    for name, src in tensors.items():
        offsets = _offsets(path, name, info, len(src.shape))
        out.append((name, src.dtype, Chunk(offsets, src.shape, path, src.offset, src.nbytes)))
    return out


def plan_shards(folder: str | Path) -> dict[str, ShardedTensor]:
    """Every full tensor of the shard files in `folder`, checked (module docstring)."""
    d = Path(folder)
    chunks: dict[str, list[Chunk]] = {}
    dtypes: dict[str, tuple[torch.dtype, Path]] = {}
    for path in list_shards(d):
        for name, dtype, chunk in read_shard(path, d):
            first = dtypes.setdefault(name, (dtype, path))
            ndim = len(chunks[name][0].sizes) if chunks.get(name) else len(chunk.sizes)
            if dtype != first[0] or len(chunk.sizes) != ndim:
                raise CheckpointError(
                    f"{path}: {shown(name)} is {_label(dtype, len(chunk.sizes))}, "
                    f"{first[1].name} holds {_label(first[0], ndim)}; the shard files disagree"
                )
            chunks.setdefault(name, []).append(chunk)
    out = {}
    for name, parts in chunks.items():
        shape = tuple(
            max(c.offsets[i] + c.sizes[i] for c in parts) for i in range(len(parts[0].sizes))
        )
        check_tiling(name, shape, parts, d)
        out[name] = ShardedTensor(name, dtypes[name][0], shape, tuple(parts))
    return out


def _label(dtype: torch.dtype, ndim: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} {ndim}-D"


@dataclass(frozen=True)
class ShardedSource(WholeTensor):
    """A full tensor of the shard files: file-to-file slabs when its chunks are slabs along
    dim 0 (FSDP2's ``Shard(0)``), else assembled in memory (one tensor)."""

    tensor: ShardedTensor
    directory: Path  # the folder of the shard files

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        shape, out = self.shape, []
        row = math.prod(shape[1:]) * self.dtype.itemsize
        for c in self.tensor.chunks:
            if not c.numel:
                continue
            if shape and (any(c.offsets[1:]) or c.sizes[1:] != shape[1:]):
                return None
            out.append(
                FileSlab(c.file, c.byte_offset, c.byte_length, c.offsets[0] * row if shape else 0)
            )
        return out

    def read(self, reader: ReadCache) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        for c in self.tensor.chunks:
            if not c.numel:
                continue
            buf = bytearray(c.byte_length)
            read_exact_into(reader.fd(c.file), buf, c.byte_offset, str(c.file))
            part = torch.frombuffer(buf, dtype=self.dtype).view(c.sizes)
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = part
        return out

    def stored(self) -> tuple[StoredTensor, ...]:
        t = self.tensor
        return (StoredTensor(DCP_SAFETENSORS, self.directory, t.key, t.dtype, t.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]
