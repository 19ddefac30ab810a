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
* a chunk saved whole by several ranks (a plain, replicated tensor: without collectives every
  rank writes its copy) is read from the lowest rank; every other pair of chunks is disjoint
  and together they tile the tensor exactly (`check_tiling`), and every byte range lies inside
  its file without overlapping another (`check_files`).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.format import DISTCP_FILE
from shardforge.formats.dcp.metadata import (
    CheckpointMetadata,
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
    missing = sorted(set(range(max(found) + 1)) - set(found) | data_ranks - set(found))
    if missing:
        raise CheckpointError(
            f"{folder}: __{missing[0]}.metadata is missing (rank {missing[0]}'s save did not "
            "finish, or the file was not copied); the checkpoint is incomplete"
        )
    return found


def read_rank_metadata(folder: str | Path) -> CheckpointMetadata:
    """Every rank's metadata of `folder`, checked as one (see the module docstring); parsed
    once per command (`io.copy.fact_session`)."""
    d = Path(folder)
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


def _read(d: Path, paths: dict[int, Path]) -> CheckpointMetadata:
    per_rank = [(path, read_entries(d, path, tile=False)) for path in paths.values()]
    for rank, (path, meta) in enumerate(per_rank):
        _own_files(rank, path, meta)
    merged = _merged(d, per_rank)
    for key, entry in merged.tensors.items():
        check_tiling(key, entry.shape, list(entry.chunks), d)
    check_files(d, merged.tensors, d / SHOWN)
    return merged


def _own_files(rank: int, path: Path, meta: CheckpointMetadata) -> None:
    for entry in meta.tensors.values():
        for c in entry.chunks:
            m = DISTCP_FILE.match(c.file.name)
            if m is None or int(m.group(1)) != rank or c.file.parent != meta.directory:
                raise CheckpointError(
                    f"{path}: stores {entry.key!r} in {c.file.name}, not one of rank {rank}'s "
                    f"__{rank}_N.distcp files; the metadata files come from different saves"
                )


def _merged(d: Path, per_rank: list[tuple[Path, CheckpointMetadata]]) -> CheckpointMetadata:
    """One metadata from the ranks' (each rank's chunks added, a replica read once)."""
    tensors: dict[str, TensorEntry] = {}
    said: dict[str, Path] = {}  # key -> the first metadata file that has it
    non_tensor: dict[str, Path] = {}
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
            boxes = {(c.offsets, c.sizes) for c in first.chunks}
            new = tuple(c for c in entry.chunks if (c.offsets, c.sizes) not in boxes)
            tensors[key] = replace(first, chunks=first.chunks + new)
        for key in meta.non_tensor_keys:
            if key in tensors:
                _disagree(path, key, "a non-tensor entry", said[key], "a tensor")
            non_tensor.setdefault(key, path)
    versions = [m.version for _, m in per_rank if m.version is not None]
    return CheckpointMetadata(d, tensors, tuple(non_tensor), versions[0] if versions else None)


def _facts(entry: TensorEntry) -> tuple[object, ...]:
    return dtype_name(entry.dtype), entry.shape, entry.path


def _shown(entry: TensorEntry) -> str:
    return f"{dtype_name(entry.dtype)} {list(entry.shape)[:8]}"


def _disagree(path: Path, key: str, this: str, other: Path, that: str) -> None:
    raise CheckpointError(
        f"{path}: {key!r} is {this}, but {other.name} says {that}; the ranks disagree (files "
        "from different saves?)"
    )
