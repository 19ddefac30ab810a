"""The metadata of a collective-free DCP save: every ``__R.metadata`` read and checked as one.

    meta = read_rank_metadata("ckpt/")      # a `CheckpointMetadata`, as `.metadata` would give

Each rank's file is parsed through the DCP allow-list profile (`formats.dcp.metadata.
read_entries`: storage paths inside the checkpoint). Then, across the ranks:

* every rank below the highest has its metadata file, and no data file belongs to a rank
  without one (a save that did not finish everywhere, or files not copied);
* each rank names only its own data files (``__R_N.distcp``, as torch's writer prefixes them):
  a metadata file copied from another rank or another save is refused;
* the ranks agree on every tensor's dtype, global shape and key path, and no key is a tensor
  for one rank and a non-tensor entry for another;
* a chunk saved by several ranks (a plain, replicated tensor: without collectives every rank
  writes its copy) is read from the lowest rank, and the other ranks' copies are kept
  (`read_rank_copies`) for the source to compare before its bytes are used
  (`formats.dcp_ranks.source`); every other pair of chunks is disjoint and together they tile
  the tensor exactly (`check_tiling`), and every byte range (the copies' too) lies inside its
  file without overlapping another (`check_files`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.format import DISTCP_FILE
from shardforge.formats.dcp.metadata import (
    CheckpointMetadata,
    Chunk,
    TensorEntry,
    check_files,
    check_tiling,
    read_entries,
)
from shardforge.io.copy import identity, session_memo
from shardforge.io.dtypes import dtype_name
from shardforge.io.files import open_regular

RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
SHOWN = "__<R>.metadata"


def list_rank_metadata(folder: Path) -> dict[int, Path]:
    """rank -> its ``__R.metadata`` file: ranks 0 .. R without a gap, and a metadata file for
    every rank that wrote data files."""
    found: dict[int, Path] = {}
    data_ranks: set[int] = set()
    for p in sorted(folder.iterdir()):
        if m := RANK_METADATA.match(p.name):
            found[int(m.group(1))] = p
        elif m := DISTCP_FILE.match(p.name):
            data_ranks.add(int(m.group(1)))
    if not found:
        raise CheckpointError(f"{folder}: no {SHOWN} files; not a collective-free DCP save")
    found = dict(sorted(found.items()))  # by rank (the names sort __10 before __2)
    missing = sorted(set(range(max(found) + 1)) - set(found) | data_ranks - set(found))
    if missing:
        raise CheckpointError(
            f"{folder}: __{missing[0]}.metadata is missing (rank {missing[0]}'s save did not "
            "finish, or the file was not copied); the checkpoint is incomplete"
        )
    return found


@dataclass(frozen=True)
class Copy:
    """A chunk `rank` saved that another rank, `kept_rank`, saved too: `kept` is read, `chunk`
    must hold the same bytes."""

    chunk: Chunk
    rank: int
    kept: Chunk
    kept_rank: int


Copies = dict[str, tuple[Copy, ...]]  # key -> the copies of its chunks that are not read


@dataclass(frozen=True)
class _Loaded:
    meta: CheckpointMetadata
    copies: Copies

    def resolved(self) -> _Loaded:
        """With torch's dtypes (`io.copy.session_memo`)."""
        return replace(self, meta=self.meta.resolved())


def read_rank_metadata(folder: str | Path) -> CheckpointMetadata:
    """Every rank's metadata of `folder`, checked as one (see the module docstring); parsed
    once per command (`io.copy.fact_session`)."""
    return _load(Path(folder)).meta


def read_rank_copies(folder: str | Path) -> Copies:
    """The copies of chunks several ranks saved, beside `read_rank_metadata`'s chunks."""
    return _load(Path(folder)).copies


def _load(d: Path) -> _Loaded:
    paths = list_rank_metadata(d)
    idents = []
    for path in paths.values():
        fd = open_regular(path, d)  # a regular file inside the checkpoint
        try:
            idents.append(identity(os.fstat(fd)))
        finally:
            os.close(fd)
    key = ("dcp-rank-metadata", os.path.abspath(d), tuple(idents))
    return session_memo(key, lambda: _read(d, paths))


def _read(d: Path, paths: dict[int, Path]) -> _Loaded:
    per_rank = [(path, read_entries(d, path, tile=False)) for path in paths.values()]
    for rank, (path, meta) in zip(paths, per_rank, strict=True):
        _own_files(rank, path, meta)
    merged, copies = _merged(d, per_rank)
    for key, entry in merged.tensors.items():
        check_tiling(key, entry.shape, list(entry.chunks), d)
    every = {  # the copies' byte ranges checked as the chunks read are
        k: replace(e, chunks=e.chunks + tuple(c.chunk for c in copies.get(k, ())))
        for k, e in merged.tensors.items()
    }
    check_files(d, every, d / SHOWN)
    return _Loaded(merged, copies)


def _own_files(rank: int, path: Path, meta: CheckpointMetadata) -> None:
    for entry in meta.tensors.values():
        for c in entry.chunks:
            m = DISTCP_FILE.match(c.file.name)
            if m is None or int(m.group(1)) != rank or c.file.parent != meta.directory:
                raise CheckpointError(
                    f"{path}: stores {entry.key!r} in {c.file.name}, not one of rank {rank}'s "
                    f"__{rank}_N.distcp files; the metadata files come from different saves"
                )


def _merged(
    d: Path, per_rank: list[tuple[Path, CheckpointMetadata]]
) -> tuple[CheckpointMetadata, Copies]:
    """One metadata from the ranks' (each rank's chunks added, a replica read once), in rank
    order, and the replicas' other copies."""
    tensors: dict[str, TensorEntry] = {}
    said: dict[str, Path] = {}  # key -> the first metadata file that has it
    non_tensor: dict[str, Path] = {}
    copies: dict[str, list[Copy]] = {}
    for path, meta in per_rank:
        for key, entry in meta.tensors.items():
            first = tensors.get(key)
            if key in non_tensor:
                _disagree(path, key, "a tensor", non_tensor[key], "a non-tensor entry")
            if first is None:
                tensors[key], said[key] = entry, path
                continue
            if _facts(entry) != _facts(first):
                _disagree(path, key, _shown(entry), said[key], _shown(first))
            boxes = {(c.offsets, c.sizes): c for c in first.chunks}
            new = tuple(c for c in entry.chunks if (c.offsets, c.sizes) not in boxes)
            for c in entry.chunks:
                if (kept := boxes.get((c.offsets, c.sizes))) is not None and c.numel:
                    copies.setdefault(key, []).append(Copy(c, _rank(c), kept, _rank(kept)))
            tensors[key] = replace(first, chunks=first.chunks + new)
        for key in meta.non_tensor_keys:
            if key in tensors:
                _disagree(path, key, "a non-tensor entry", said[key], "a tensor")
            non_tensor.setdefault(key, path)
    versions = [m.version for _, m in per_rank if m.version is not None]
    merged = CheckpointMetadata(d, tensors, tuple(non_tensor), versions[0] if versions else None)
    return merged, {k: tuple(v) for k, v in copies.items()}


def _rank(c: Chunk) -> int:
    """The rank that wrote the chunk (its file's name: checked by `_own_files`)."""
    m = DISTCP_FILE.match(c.file.name)
    assert m is not None
    return int(m.group(1))


def _facts(entry: TensorEntry) -> tuple[object, ...]:
    return dtype_name(entry.dtype), entry.shape, entry.path


def _shown(entry: TensorEntry) -> str:
    return f"{dtype_name(entry.dtype)} {list(entry.shape)[:8]}"


def _disagree(path: Path, key: str, this: str, other: Path, that: str) -> None:
    raise CheckpointError(
        f"{path}: {key!r} is {this}, but {other.name} says {that}; the ranks disagree (files "
        "from different saves?)"
    )
