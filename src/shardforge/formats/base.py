"""The protocol every checkpoint format implements, and what its methods return.

A format is one folder under `shardforge.formats` and one row of `formats.registry.FORMATS`: a
`CheckpointFormat` subclass that answers, for a folder it recognises,

* `detect(folder)`: whether the folder is a checkpoint of this format (file names only);
* `open(folder)`: every tensor as a `NamedSource`, from metadata alone (no tensor bytes read);
* `describe(folder)`: the `Contents` `shardforge inspect` prints (tensors, world size,
  optimizer and other training state), from metadata alone;
* `shard_files(folder)`: the files `--remove_checkpoint_dir` may delete (the model shards the
  merge reads, nothing else); refused with a `MergeError` where other state shares them;
* `reference(location)`: a `ReferenceReader` that reads stored tensors through another code path
  than `open` (torch's own readers, the `safetensors` library), for `--verify`.

This module imports no torch: finding a checkpoint (`detect`) runs before torch is imported.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from shardforge.io.copy import FileSlab, ReadCache

if TYPE_CHECKING:
    import torch

Progress = Callable[[int], None]
Rows = tuple[int, int]


@dataclass(frozen=True)
class Destination:
    """Where a tensor's bytes go: byte `offset` of the open output file `fd`, in `dtype`;
    `progress` hears every byte count written."""

    fd: int
    offset: int
    dtype: torch.dtype
    progress: Progress


class Sized:
    """`numel` and `nbytes` of anything with a `shape` and a `dtype` (an entry, a plan)."""

    shape: tuple[int, ...]
    dtype: Any

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Described:
    """`shape` and `dtype` of the tensor `described` (a metadata entry, another source)."""

    @property
    def described(self) -> Any:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.described.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.described.dtype


@dataclass(frozen=True)
class StoredTensor(Sized):
    """A tensor as its checkpoint stores it, named for a reader other than the merge's (the
    format's `reference`): the format's name, where it is (a folder, or a file for
    safetensors), the key there, dtype and shape."""

    fmt: str
    directory: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@runtime_checkable
class TensorSource(Protocol):
    """One full tensor of some input."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None: ...

    def read(self, reader: ReadCache) -> torch.Tensor: ...

    def stored(self) -> tuple[StoredTensor, ...]:
        """The stored tensors this one is made of (for verification's independent read)."""
        ...

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """This tensor (as `read` returns it) from its `stored()` tensors, read elsewhere."""
        ...

    def write(self, reader: ReadCache, dest: Destination, rows: Rows | None = None) -> None:
        """The tensor cast to `dest.dtype` at byte `dest.offset` of `dest.fd`; with `rows`,
        only rows [start, stop) along dim 0 (all of a 0-d tensor), at their place in it (one
        rank's share of a distributed merge)."""
        ...


@dataclass(frozen=True)
class NamedSource(Described):
    """One tensor of a checkpoint: its original path of keys (for key mapping) and its source."""

    path: tuple[str, ...]
    source: TensorSource

    @property
    def described(self) -> TensorSource:
        return self.source


# ------------------------------------------------------------------------------ describe


@dataclass(frozen=True)
class TensorFact:
    """One model tensor: its checkpoint key, dtype, global shape, element and byte counts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int

    @classmethod
    def of(cls, name: str, tensor: Any) -> TensorFact:
        """The fact of anything with a `dtype` and a `shape` (a plan, an entry, a source)."""
        numel = math.prod(tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return cls(name, dtype, tuple(tensor.shape), numel, numel * tensor.dtype.itemsize)


@dataclass(frozen=True)
class StateSummary:
    """Optimizer (or other training) state: where it is and how much.

    `tensor_count` and `total_bytes` come from metadata (None for files that are not read);
    `files_bytes` is the size on disk of the files that hold it (None when mixed in with the
    model).
    """

    location: str  # "beside" (own DCP dir), "mixed" (same DCP), "files" (per-rank files)
    path: str
    tensor_count: int | None
    non_tensor_count: int | None
    total_bytes: int | None
    files: int
    files_bytes: int | None


@dataclass(frozen=True)
class Contents:
    """What a format found in one model directory (`CheckpointFormat.describe`)."""

    storage: str
    tensors: tuple[TensorFact, ...]
    non_tensor_keys: tuple[str, ...]
    world_size: int | None
    world_size_source: str | None
    optimizer: StateSummary | None = None
    other_state: StateSummary | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_rank_files(
        cls,
        storage: str,
        plan: Mapping[str, Any],
        world_size: int,
        names_shown: str,
        optimizer: StateSummary | None = None,
        other_state: StateSummary | None = None,
    ) -> Contents:
        """The contents of per-rank files: the tensors of `plan` (anything with a dtype and a
        shape), no other entries, the world size read from the file names `names_shown`."""
        return cls(
            storage=storage,
            tensors=tuple(TensorFact.of(k, t) for k, t in plan.items()),
            non_tensor_keys=(),
            world_size=world_size,
            world_size_source=f"{names_shown} file names",
            optimizer=optimizer,
            other_state=other_state,
        )


# ----------------------------------------------------------------------------- reference


class ReferenceReader(ABC):
    """A format's independent reader (verification): never the merge's own parser."""

    @abstractmethod
    def check_crcs(self, keys: set[str]) -> None:
        """Check the stored checksums of the records holding `keys` (where the format has
        them); `MergeError`/`CheckpointError` on a mismatch."""

    @abstractmethod
    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        """Every wanted tensor by key, read by the reference path."""


# ------------------------------------------------------------------------------ identity


@dataclass(frozen=True)
class StoredRecord:
    """A ``torch.save`` zip archive inside a source file: its byte range, and the CRC-32 its
    writer stored for each member holding tensor bytes (member name, CRC-32)."""

    offset: int
    length: int
    crc32: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class SourceFile:
    """One file a merge reads: where it is (relative to the checkpoint), its size, and its
    records where the format has them (an output's integrity manifest lists these)."""

    path: PurePath
    size: int
    records: tuple[StoredRecord, ...] = ()


# -------------------------------------------------------------------------------- format

# how a refused `shard_files` (and --remove_checkpoint_dir) ends its message
NOT_REMOVED = "merge without --remove_checkpoint_dir"


class CheckpointFormat(ABC):
    """One checkpoint format (see the module docstring). Subclasses are the registry's rows."""

    # the name layouts, `StoredTensor.fmt` and `inspect` use
    name: ClassVar[str]
    # what a folder of this format holds, in words (for errors that list what was looked for)
    looked_for: ClassVar[str]
    # which files `shard_files` lists, in words (logged by --remove_checkpoint_dir)
    shards_described: ClassVar[str]
    # whether a checkpoint root may hold it as a sharded checkpoint to merge (a Hugging Face
    # safetensors directory is a base model or an output, never merged)
    sharded: ClassVar[bool] = True

    @abstractmethod
    def detect(self, folder: Path) -> bool:
        """Whether `folder` is a checkpoint of this format (file names only, no torch)."""

    @abstractmethod
    def open(self, folder: Path) -> dict[str, NamedSource]:
        """Every tensor by checkpoint key, from metadata alone."""

    @abstractmethod
    def describe(self, folder: Path) -> Contents:
        """What `shardforge inspect` reports about the folder, from metadata alone."""

    @abstractmethod
    def shard_files(self, folder: Path) -> list[PurePath]:
        """The model shard files of `folder`, relative to it: what the merge reads and what
        `--remove_checkpoint_dir` may delete. `MergeError` where other state shares them."""

    @abstractmethod
    def reference(self, location: Path) -> ReferenceReader:
        """An independent reader of the stored tensors at `location` (`StoredTensor.directory`)."""

    def identity(self, location: Path) -> list[SourceFile]:
        """What a merge read at `location` (`StoredTensor.directory`: a folder, or one file):
        its files, their sizes and, where the format has them, their records' stored CRC-32s
        (`sinks.manifest` records them; `shardforge verify --checkpoint` checks them). This
        default: the `shard_files` (or the one file) with their sizes."""
        if location.is_file():
            return [SourceFile(PurePath(location.name), location.stat().st_size)]
        return [SourceFile(p, (location / p).stat().st_size) for p in self.shard_files(location)]
