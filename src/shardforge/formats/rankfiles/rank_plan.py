"""Plan the assembly of full tensors from a set of per-rank DTensor files.

    plan = plan_rank_files("global_step_100/actor")    # key -> TensorPlan; all checks first

(`shardforge.formats.sources.RankFileSource` then reads one full tensor at a time, or copies its slabs.)

Each rank's local shard is placed where torch puts it: ``Shard(d)`` on a mesh dimension of
size n gives coordinate c the c-th ``torch.chunk``-style piece (ceil(len/n) rows each, the last
ones shorter or empty); ``Replicate()`` gives every coordinate the whole extent, and the copy
held by the lowest rank is read. Multi-axis meshes (HSDP: ``(Replicate(), Shard(0))``) follow
from the same rule applied per mesh dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.base import Sized
from shardforge.formats.rankfiles.names import RANK_NAMES, RankNames
from shardforge.formats.rankfiles.pickles import Placement
from shardforge.formats.rankfiles.rank_file import RankFile, TensorRecord, read_rank_file


@dataclass(frozen=True)
class Piece:
    """One local shard to read and where it goes in the full tensor."""

    rank: int
    offsets: tuple[int, ...]
    record: TensorRecord

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.record.local_shape


@dataclass(frozen=True)
class Slab:
    """A byte range of a rank file that is a contiguous part of the full tensor's bytes."""

    path: Path
    src_offset: int  # absolute offset in `path`
    nbytes: int
    dst_offset: int  # offset in the full tensor's C-order bytes


@dataclass(frozen=True)
class TensorPlan(Sized):
    """How one full tensor is assembled: its metadata and the distinct pieces to read."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def slabs(self) -> list[Slab] | None:
        """The pieces as verbatim byte copies, when every piece is a contiguous slab along dim 0
        (the usual FSDP2 ``Shard(0)`` case); None when some piece must be assembled in memory.

        Copying each slab's bytes to ``tensor_start + dst_offset`` yields the full tensor in C
        order, so a writer can copy file to file without reading the data through Python.
        """
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        out = []
        for piece in self.pieces:
            rec = piece.record
            if not rec.contiguous or piece.sizes[1:] != self.shape[1:] or any(piece.offsets[1:]):
                return None
            src = rec.data_offset + rec.storage_offset * self.dtype.itemsize
            out.append(
                Slab(
                    rec.path,
                    src,
                    rec.local_numel * self.dtype.itemsize,
                    piece.offsets[0] * row if self.shape else 0,
                )
            )
        return out


def local_box(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the local shard at `coordinate`, as torch's Shard/Replicate place it."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, p in enumerate(placements):
        if p.kind != "shard":
            continue
        assert p.dim is not None
        n, c, full = mesh_shape[mesh_dim], coordinate[mesh_dim], sizes[p.dim]
        chunk = -(-full // n)
        start = min(c * chunk, full)
        sizes[p.dim] = min(full, start + chunk) - start
        offsets[p.dim] += start
    return tuple(offsets), tuple(sizes)


def list_rank_files(directory: str | Path, names: RankNames = RANK_NAMES) -> dict[int, Path]:
    """rank -> path of the per-rank model files in `directory` (`names`: how the format names
    them; one world size only, every rank below it present)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    found: dict[int | None, dict[int, Path]] = {}
    for p in sorted(d.iterdir()):
        parsed = names.parse(p)
        if parsed is not None and p.is_file():
            found.setdefault(parsed[0], {})[parsed[1]] = p
    if not found:
        raise CheckpointError(f"{d}: no {names.shown} files")
    if len(found) > 1:
        sizes = ", ".join(str(w) for w in sorted(w for w in found if w is not None))
        raise CheckpointError(
            f"{d}: rank files of different world sizes ({sizes}) are mixed in one folder; "
            "keep only the files of one run"
        )
    named_world, ranks = next(iter(found.items()))
    world_size = named_world if named_world is not None else max(ranks) + 1
    missing = [r for r in range(world_size) if r not in ranks]
    if missing:
        listed = ", ".join(names.file(world_size, r) for r in missing)
        raise CheckpointError(f"{d}: rank file(s) missing: {listed}")
    extra = sorted(r for r in ranks if r >= world_size)
    if extra:
        raise CheckpointError(f"{d}: rank {extra[0]} is not below world size {world_size}")
    return dict(sorted(ranks.items()))


def read_rank_files(directory: str | Path, names: RankNames = RANK_NAMES) -> list[RankFile]:
    """Every per-rank model file of `directory`, parsed (metadata only), in rank order."""
    paths = list_rank_files(directory, names)
    return [read_rank_file(p, (len(paths), rank)) for rank, p in paths.items()]


def _mesh_of(recs: list[TensorRecord], world_size: int) -> tuple[tuple[int, ...], list[tuple]]:
    first = recs[0]
    ndim = len(first.placements)
    coords = []
    for rank, rec in enumerate(recs):
        coord = rec.coordinate
        if coord is None and ndim == 1:
            coord = (rank,)
        if coord is None or len(coord) != ndim:
            raise CheckpointError(f"{rec.path}: {rec.key!r}: this rank's mesh position is unknown")
        coords.append(coord)
    mesh_shape = first.mesh_shape or tuple(max(c[i] for c in coords) + 1 for i in range(ndim))
    if len(mesh_shape) != ndim:
        raise CheckpointError(f"{first.path}: {first.key!r}: mesh and placements disagree")
    if math.prod(mesh_shape) != world_size:
        raise CheckpointError(
            f"{first.path}: {first.key!r} lies on {math.prod(mesh_shape)} ranks (mesh "
            f"{mesh_shape}), {world_size} rank files found; a rank file is missing, or the "
            "mesh spans ranks that wrote none"
        )
    seen: dict[tuple[int, ...], Path] = {}
    for rec, coord in zip(recs, coords, strict=True):
        if any(not 0 <= c < n for c, n in zip(coord, mesh_shape, strict=True)):
            raise CheckpointError(
                f"{rec.path}: {rec.key!r}: mesh position {coord} is outside mesh {mesh_shape}"
            )
        if coord in seen:
            raise CheckpointError(
                f"{rec.path} and {seen[coord].name} hold the same mesh position {coord} for "
                f"{rec.key!r}: a rank file is duplicated or comes from another run"
            )
        seen[coord] = rec.path
    return mesh_shape, coords


def _plan_key(key: str, recs: list[TensorRecord]) -> TensorPlan:
    first = recs[0]
    for rec in recs[1:]:
        same = (rec.dtype, rec.global_shape, rec.placements) == (
            first.dtype,
            first.global_shape,
            first.placements,
        )
        if not same:
            raise CheckpointError(
                f"{rec.path}: {key!r} is {rec.dtype} {list(rec.global_shape)} "
                f"{[str(p) for p in rec.placements]} but {first.path.name} says {first.dtype} "
                f"{list(first.global_shape)} {[str(p) for p in first.placements]}"
            )
        if rec.mesh_shape != first.mesh_shape:
            raise CheckpointError(
                f"{rec.path}: {key!r} is on a device mesh of shape {rec.mesh_shape} but "
                f"{first.path.name} says {first.mesh_shape}"
            )
    shape = first.global_shape
    if not first.is_dtensor:  # a plain tensor saved by every rank: take rank 0's
        return TensorPlan(key, first.dtype, shape, (), (), (Piece(0, (0,) * len(shape), first),))
    for p in first.placements:
        if p.kind == "shard" and not (p.dim is not None and 0 <= p.dim < len(shape)):
            raise CheckpointError(f"{first.path}: {key!r}: {p} on a {len(shape)}-D tensor")
    mesh_shape, coords = _mesh_of(recs, len(recs))
    pieces: dict[tuple[int, ...], Piece] = {}
    for rank, (rec, coord) in enumerate(zip(recs, coords, strict=True)):
        offsets, sizes = local_box(shape, first.placements, mesh_shape, coord)
        if sizes != rec.local_shape:
            raise CheckpointError(
                f"{rec.path}: {key!r} holds a local shard of shape {list(rec.local_shape)}, "
                f"but {[str(p) for p in first.placements]} on mesh {mesh_shape} gives "
                f"{list(sizes)} at position {coord}"
            )
        if math.prod(sizes) and offsets not in pieces:
            pieces[offsets] = Piece(rank, offsets, rec)
    covered = sum(math.prod(p.sizes) for p in pieces.values())
    if covered != math.prod(shape):
        raise CheckpointError(
            f"{first.path.parent}: {key!r}: the ranks' shards cover {covered} of "
            f"{math.prod(shape)} elements"
        )
    return TensorPlan(key, first.dtype, shape, first.placements, mesh_shape, tuple(pieces.values()))


def plan_from_files(files: list[RankFile]) -> dict[str, TensorPlan]:
    """Check that the rank files agree and plan every key (in rank 0's key order)."""
    keys0 = list(files[0].tensors)
    for rf in files[1:]:
        if set(rf.tensors) != set(keys0):
            diff = sorted(set(rf.tensors) ^ set(keys0))
            raise CheckpointError(
                f"{rf.path}: its keys differ from {files[0].path.name}'s (e.g. {diff[0]!r})"
            )
    return {key: _plan_key(key, [rf.tensors[key] for rf in files]) for key in keys0}


def plan_rank_files(directory: str | Path, names: RankNames = RANK_NAMES) -> dict[str, TensorPlan]:
    """Open every rank file of `directory` (metadata only) and plan each full tensor."""
    return plan_from_files(read_rank_files(directory, names))
