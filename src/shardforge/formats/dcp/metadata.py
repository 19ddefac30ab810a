"""A DCP checkpoint's `.metadata` as plain, checked records (nothing downstream touches pickle)."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from shardforge.errors import CheckpointError
from shardforge.formats.base import Sized
from shardforge.formats.dcp.pickles import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
    load_metadata_pickle,
)
from shardforge.io.copy import file_fact, identity
from shardforge.io.dtypes import DtypeName, is_dtype, resolve_dtype
from shardforge.io.files import inside, open_regular
from shardforge.io.remote import pread

if TYPE_CHECKING:
    import torch

METADATA_FILE = ".metadata"
TORCH_ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: where it sits in the global tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    byte_offset: int
    byte_length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry(Sized):
    """One tensor of the checkpoint under its flat DCP key."""

    key: str
    path: tuple[str, ...]
    dtype: torch.dtype  # a `DtypeName` when read before torch is imported (io.dtypes)
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class CheckpointMetadata:
    """The tensors of a DCP directory (non-tensor entries are listed by key only)."""

    directory: Path
    tensors: dict[str, TensorEntry]
    non_tensor_keys: tuple[str, ...]
    version: str | None = None  # the format version torch 2.9+ records in `.metadata`

    def resolved(self) -> CheckpointMetadata:
        """This metadata with torch's dtypes where it was read before torch's import."""
        if not any(isinstance(e.dtype, DtypeName) for e in self.tensors.values()):
            return self
        tensors = {k: replace(e, dtype=resolve_dtype(e.dtype)) for k, e in self.tensors.items()}
        return replace(self, tensors=tensors)


def _safe_relative(directory: Path, relative: Any, key: str, meta_path: Path) -> Path:
    rel = PurePath(str(relative))
    if (
        rel.is_absolute()
        or ".." in rel.parts
        or str(relative).startswith(("/", "\\"))
        or not inside(directory / rel, directory)
    ):
        raise CheckpointError(
            f"{meta_path}: storage path {str(relative)!r} of {key!r} leaves the "
            "checkpoint directory; refusing to read it"
        )
    return directory / rel


def check_tiling(key: str, shape: tuple[int, ...], chunks: list[Chunk], where: Path) -> None:
    """The chunks tile the tensor exactly: each lies inside it, no two overlap, and together
    they hold every element (Python integers: nothing overflows)."""
    if any(d < 0 for d in shape):
        raise CheckpointError(f"{where}: {key!r} has a negative dimension in {list(shape)[:8]}")
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise CheckpointError(
                f"{where}: a chunk of {key!r} has {len(c.sizes)} dimensions, the tensor "
                f"{len(shape)}; corrupt checkpoint"
            )
        if any(
            o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape, strict=True)
        ):
            raise CheckpointError(
                f"{where}: chunk at {list(c.offsets)[:8]} of size {list(c.sizes)[:8]} of {key!r} "
                f"lies outside its shape {list(shape)[:8]}; corrupt checkpoint"
            )
    # sweep along dim 0: only chunks whose rows meet can overlap
    nonempty = sorted((c for c in chunks if c.numel > 0), key=lambda c: c.offsets)
    active: list[Chunk] = []
    for c in nonempty:
        if shape:
            active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, c.offsets, c.sizes, strict=True)
            ):
                raise CheckpointError(
                    f"{where}: chunks at {list(a.offsets)[:8]} and {list(c.offsets)[:8]} of "
                    f"{key!r} overlap; corrupt checkpoint"
                )
        active.append(c)
    total = sum(c.numel for c in nonempty)
    if total != math.prod(shape):
        raise CheckpointError(
            f"{where}: incomplete checkpoint: the chunks of {key!r} cover {total} of "
            f"{math.prod(shape)} elements"
        )


def _data_file(directory: Path, path: Path, meta_path: Path) -> int:
    """The size of a data file named in `meta_path` (a regular file inside `directory`, in
    torch.save format)."""
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{path}: data file named in {meta_path} is missing; the "
            "checkpoint is incomplete (copy every __*.distcp file)"
        )
    fd = open_regular(path, directory)
    try:
        size = os.fstat(fd).st_size
        head = pread(fd, 4, 0)  # a stand-in of a stored object: one ranged request
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if head and head != TORCH_ZIP_MAGIC:
        fmt = "DCP safetensors format" if head[:1] != b"P" else "an unknown format"
        raise CheckpointError(
            f"{path}: stored in {fmt}, which this merge does not read; save with the default "
            "DCP format or use torch's own consolidation"
        )
    return size


def check_files(directory: Path, tensors: dict[str, TensorEntry], meta_path: Path) -> None:
    """Every data file is a regular file inside the directory; every chunk's byte range lies
    inside its file, and no two chunks' byte ranges overlap (`meta_path` names the metadata
    in messages)."""
    sizes: dict[Path, int] = {}
    ranges: dict[Path, list[tuple[int, int, str]]] = {}
    for entry in tensors.values():
        for c in entry.chunks:
            if c.byte_offset < 0 or c.byte_length < 0:
                raise CheckpointError(
                    f"{meta_path}: {entry.key!r} has a chunk at byte "
                    f"{c.byte_offset} of length {c.byte_length} in {c.file.name}; corrupt "
                    "metadata"
                )
            if c.file not in sizes:
                sizes[c.file] = _data_file(directory, c.file, meta_path)
            end = c.byte_offset + c.byte_length
            if end > sizes[c.file]:
                raise CheckpointError(
                    f"{c.file}: truncated: {entry.key!r} needs bytes up to {end} but the file has "
                    f"{sizes[c.file]}; the checkpoint is incomplete or was cut off while copying"
                )
            ranges.setdefault(c.file, []).append((c.byte_offset, end, entry.key))
    for path, spans in ranges.items():
        spans.sort()
        for (a_start, a_end, a), (b_start, _, b) in itertools.pairwise(spans):
            if b_start < a_end:
                same = "the same" if a_start == b_start else "overlapping"
                raise CheckpointError(
                    f"{meta_path}: {a!r} and {b!r} are stored at {same} bytes "
                    f"({a_start} and {b_start}) of {path.name}; corrupt or crafted metadata"
                )


def read_metadata(directory: str | Path) -> CheckpointMetadata:
    """Read and check a DCP directory's `.metadata`: every chunk's file exists, is long enough,
    stays inside the directory and the chunks of each tensor tile it exactly."""
    d = Path(directory)
    meta_path = d / METADATA_FILE
    if os.path.lexists(meta_path):
        fd = open_regular(meta_path, d)  # a regular file inside the checkpoint
        try:
            ident = identity(os.fstat(fd))
        finally:
            os.close(fd)
    else:
        per_rank = sorted(p.name for p in d.glob("__*.metadata"))
        if per_rank:
            raise CheckpointError(
                f"{d}: has per-rank metadata ({per_rank[0]}, ...) from use_collectives=False and "
                "no global .metadata; it is read as a collective-free DCP (format dcp-ranks), "
                "not here"
            )
        raise CheckpointError(f"{d}: no {METADATA_FILE} file; not a complete DCP checkpoint")
    # parsed once per merge, head start included (`io.copy.fact_session`)
    where = Path(os.path.abspath(meta_path))
    return file_fact("dcp-metadata", where, ident, lambda: _read(d, meta_path))


def _read(d: Path, meta_path: Path) -> CheckpointMetadata:
    meta = read_entries(d, meta_path, tile=True)
    check_files(d, meta.tensors, meta_path)
    return meta


def read_entries(d: Path, meta_path: Path, tile: bool) -> CheckpointMetadata:
    """The entries of the metadata file `meta_path` of the DCP directory `d`, each storage path
    checked to stay inside `d`; with `tile`, each tensor's chunks checked to tile it
    (`check_tiling`). The data files are not looked at (`check_files`)."""
    raw = load_metadata_pickle(meta_path)
    try:
        tensors, non_tensor = _parse(raw, d, meta_path, tile)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as exc:
        reason = f"{type(exc).__name__}: {exc}"[:200]
        raise CheckpointError(f"{meta_path}: malformed DCP metadata ({reason})") from None
    version = getattr(raw, "version", None)
    return CheckpointMetadata(
        d, tensors, tuple(non_tensor), version if isinstance(version, str) else None
    )


def _parse(
    raw: Any, d: Path, meta_path: Path, tile: bool
) -> tuple[dict[str, TensorEntry], list[str]]:
    """The tensor entries of an unpickled Metadata record (file checks are separate)."""
    if not isinstance(raw, Metadata):
        raise CheckpointError(f"{meta_path}: not a DCP Metadata object")
    sd_meta = getattr(raw, "state_dict_metadata", None)
    storage = getattr(raw, "storage_data", None)
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{meta_path}: not a DCP Metadata object")
    planner = getattr(raw, "planner_data", None) or {}

    # (fqn, offsets) -> storage info
    where: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in storage.items():
        offset = tuple(int(x) for x in (getattr(index, "offset", None) or ()))
        where[(str(index.fqn), offset)] = info

    tensors: dict[str, TensorEntry] = {}
    non_tensor: list[str] = []
    files: dict[str, Path] = {}  # relative path -> checked path (resolving links costs syscalls)
    for key, item in sd_meta.items():
        if isinstance(item, BytesStorageMetadata):
            non_tensor.append(key)
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{meta_path}: unknown entry type for {key!r}")
        shape = tuple(int(x) for x in item.size)
        chunks: list[Chunk] = []
        for cm in item.chunks:
            offsets = tuple(int(x) for x in cm.offsets)
            sizes = tuple(int(x) for x in cm.sizes)
            info = where.get((key, offsets))
            if info is None and math.prod(sizes) == 0:
                continue  # uneven sharding: an empty chunk need not be stored
            if info is None:
                raise CheckpointError(
                    f"{meta_path}: no storage recorded for chunk {offsets} of {key!r}; corrupt"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{meta_path}: {key!r} is stored with transforms "
                    f"{list(info.transform_descriptors)} (compression); not supported, save "
                    "without compression or use torch's own loader"
                )
            relative = str(info.relative_path)
            if relative not in files:
                files[relative] = _safe_relative(d, info.relative_path, key, meta_path)
            chunks.append(
                Chunk(offsets, sizes, files[relative], int(info.offset), int(info.length))
            )
        if tile:
            check_tiling(key, shape, chunks, meta_path)
        path = planner.get(key)
        path_t = tuple(str(p) for p in path) if isinstance(path, tuple | list) else (key,)
        dtype: Any = getattr(item.properties, "dtype", None)
        if not is_dtype(dtype):
            raise CheckpointError(f"{meta_path}: no dtype recorded for {key!r}")
        tensors[key] = TensorEntry(key, path_t, dtype, shape, tuple(chunks))
    return tensors, non_tensor
