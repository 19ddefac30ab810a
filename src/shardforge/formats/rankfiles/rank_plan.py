"""Plan the assembly of full tensors from a set of per-rank DTensor files.

    plan = plan_rank_files("global_step_100/actor")    # key -> TensorPlan; all checks first

(`shardforge.formats.rankfiles.source.RankFileSource` then reads one full tensor at a time, or
copies its slabs.)

Each rank's local shard is placed where torch puts it (`formats.rankfiles.mesh`: ``Shard``,
``_StridedShard`` and ``Replicate`` over meshes of any number of dimensions, each dimension's
indices proven to tile the tensor). A tensor on a mesh smaller than the set of files (FSDP2's
data-parallel sub-mesh of a 2-D FSDP + TP mesh: the embedding on ``dp`` only) and a tensor
replicated over a mesh dimension are held by several ranks: the copy held by the lowest rank is
read, the others are kept as `TensorPlan.copies` for the source to compare byte for byte. A
plain tensor saved by every rank is the same: rank 0's is read, every other rank's compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.base import Sized
from shardforge.formats.rankfiles.mesh import (
    Runs,
    Unmodelled,
    blocks,
    check_modelled,
    check_tiling,
    local_runs,
)
from shardforge.formats.rankfiles.names import RANK_NAMES, RankNames
from shardforge.formats.rankfiles.pickles import Placement
from shardforge.formats.rankfiles.rank_file import RankFile, TensorRecord, read_rank_file


@dataclass(frozen=True)
class Piece:
    """One local shard to read and where it goes in the full tensor: per tensor dimension, the
    runs of global indices (first, count) its rows hold, in order (one run for an ordinary
    shard; several for a strided one)."""

    rank: int
    runs: tuple[Runs, ...]
    record: TensorRecord

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where the piece starts along every dimension."""
        return tuple(r[0][0] if r else 0 for r in self.runs)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.record.local_shape

    def blocks(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(global offsets, local offsets, sizes) of each box of the piece."""
        return blocks(self.runs)


@dataclass(frozen=True)
class Slab:
    """A byte range of a rank file that is a contiguous part of the full tensor's bytes."""

    path: Path
    src_offset: int  # absolute offset in `path`
    nbytes: int
    dst_offset: int  # offset in the full tensor's C-order bytes


@dataclass(frozen=True)
class TensorPlan(Sized):
    """How one full tensor is assembled: its metadata, the distinct pieces to read, and the
    copies other ranks hold of them (`copies`: (copy, the piece it must equal))."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    copies: tuple[tuple[Piece, Piece], ...] = ()

    def slabs(self) -> list[Slab] | None:
        """The pieces as verbatim byte copies, when every piece's rows are whole rows of the
        tensor (the usual FSDP2 ``Shard(0)`` case, and FSDP2 + TP's ``_StridedShard(0)``);
        None when some piece must be assembled in memory.

        Copying each slab's bytes to ``tensor_start + dst_offset`` yields the full tensor in C
        order, so a writer can copy file to file without reading the data through Python.
        """
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        out = []
        for piece in self.pieces:
            rec = piece.record
            if not rec.contiguous or piece.sizes[1:] != self.shape[1:]:
                return None
            start = rec.data_offset + rec.storage_offset * self.dtype.itemsize
            if not self.shape:
                out.append(Slab(rec.path, start, self.dtype.itemsize, 0))
                continue
            local = 0
            for first, n in piece.runs[0]:
                out.append(Slab(rec.path, start + local * row, n * row, first * row))
                local += n
        return out


def _placements_text(placements: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(map(str, placements)) + ")"


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


def _coordinates(recs: list[TensorRecord], ndim: int) -> list[tuple[int, ...]]:
    coords = []
    for rank, rec in enumerate(recs):
        coord = rec.coordinate
        if coord is None and ndim == 1 and len(recs) == (rec.mesh_shape or (len(recs),))[0]:
            coord = (rank,)
        if coord is None or len(coord) != ndim:
            raise CheckpointError(f"{rec.path}: {rec.key!r}: this rank's mesh position is unknown")
        if rec.mesh_rank is not None and rec.mesh_rank != rank:
            raise CheckpointError(
                f"{rec.path}: {rec.key!r} was saved by rank {rec.mesh_rank}: a rank file is "
                "renamed or comes from another run"
            )
        coords.append(coord)
    return coords


def _mesh_of(recs: list[TensorRecord], world_size: int) -> tuple[tuple[int, ...], list[tuple]]:
    """The mesh shape and every rank's coordinate; each coordinate is held by the same number
    of ranks (one when the mesh spans every file; more for a sub-mesh of a larger one)."""
    first = recs[0]
    ndim = len(first.placements)
    coords = _coordinates(recs, ndim)
    mesh_shape = first.mesh_shape or tuple(max(c[i] for c in coords) + 1 for i in range(ndim))
    if len(mesh_shape) != ndim:
        raise CheckpointError(f"{first.path}: {first.key!r}: mesh and placements disagree")
    size = math.prod(mesh_shape)
    if not size or world_size % size:
        raise CheckpointError(
            f"{first.path}: {first.key!r} lies on {size} ranks (mesh "
            f"{mesh_shape}), {world_size} rank files found; a rank file is missing, or the "
            "mesh spans ranks that wrote none"
        )
    seen: dict[tuple[int, ...], list[Path]] = {}
    for rec, coord in zip(recs, coords, strict=True):
        if any(not 0 <= c < n for c, n in zip(coord, mesh_shape, strict=True)):
            raise CheckpointError(
                f"{rec.path}: {rec.key!r}: mesh position {coord} is outside mesh {mesh_shape}"
            )
        held = seen.setdefault(coord, [])
        if len(held) == world_size // size:
            raise CheckpointError(
                f"{rec.path} and {held[0].name} hold the same mesh position {coord} for "
                f"{rec.key!r}: a rank file is duplicated or comes from another run"
            )
        held.append(rec.path)
    return mesh_shape, coords


def _check_agree(key: str, recs: list[TensorRecord]) -> None:
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
        if (rec.mesh_shape, rec.shard_order) != (first.mesh_shape, first.shard_order):
            raise CheckpointError(
                f"{rec.path}: {key!r} is on a device mesh of shape {rec.mesh_shape} but "
                f"{first.path.name} says {first.mesh_shape}"
            )


def _pieces(
    key: str, recs: list[TensorRecord], runs: list[tuple[Runs, ...]]
) -> tuple[tuple[Piece, ...], tuple[tuple[Piece, Piece], ...]]:
    """The distinct pieces (the lowest rank's copy of each) and every other copy."""
    pieces: dict[tuple[Runs, ...], Piece] = {}
    copies: list[tuple[Piece, Piece]] = []
    for rank, (rec, held) in enumerate(zip(recs, runs, strict=True)):
        if rec.local_shape != tuple(sum(n for _, n in r) for r in held):
            raise CheckpointError(
                f"{rec.path}: {key!r} holds a local shard of shape {list(rec.local_shape)}, "
                f"but {_placements_text(rec.placements)} on mesh {rec.mesh_shape} gives "
                f"{[sum(n for _, n in r) for r in held]} at position {rec.coordinate}"
            )
        piece = Piece(rank, held, rec)
        if rec.local_numel == 0 and math.prod(rec.global_shape) > 0:
            continue
        if held in pieces:
            copies.append((piece, pieces[held]))
        else:
            pieces[held] = piece
    return tuple(pieces.values()), tuple(copies)


def _plan_key(key: str, recs: list[TensorRecord]) -> TensorPlan:
    first = recs[0]
    _check_agree(key, recs)
    shape = first.global_shape
    if not first.is_dtensor:  # a plain tensor saved by every rank: read rank 0's, compare
        whole = tuple(((0, n),) if n else () for n in shape)
        pieces, copies = _pieces(key, recs, [whole] * len(recs))
        return TensorPlan(key, first.dtype, shape, (), (), pieces, copies)
    mesh_shape, coords = _mesh_of(recs, len(recs))
    try:
        check_modelled(shape, first.placements, first.shard_order)
        check_tiling(shape, first.placements, mesh_shape)
        runs = [local_runs(shape, first.placements, mesh_shape, c) for c in coords]
    except Unmodelled as exc:
        raise CheckpointError(
            f"{first.path.parent}: tensor {key!r} has placements "
            f"{_placements_text(first.placements)} on a mesh of shape {mesh_shape}: {exc}; "
            "shardforge cannot merge it"
        ) from None
    pieces, copies = _pieces(key, recs, runs)
    covered = sum(math.prod(p.sizes) for p in pieces)
    if covered != math.prod(shape):  # (proven by check_tiling; a last guard)
        raise CheckpointError(
            f"{first.path.parent}: {key!r}: the ranks' shards cover {covered} of "
            f"{math.prod(shape)} elements"
        )
    return TensorPlan(key, first.dtype, shape, first.placements, mesh_shape, pieces, copies)


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
