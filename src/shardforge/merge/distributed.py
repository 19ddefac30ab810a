"""The merge on several ranks (gloo, CPU only; one machine or many on a shared file system).

Every rank prepares the same plan (the checkpoint's metadata, the meta-device architecture),
so every output byte range is known up front. The tensor bytes of all planned files, taken in
plan order, are cut into `world` equal spans (`shares`): a rank copies or computes exactly the
bytes of its span, so ranks write disjoint ranges of the same files and one large tensor (an
embedding) is split across ranks by rows; outputs made together from one value in memory (a
converter's group, experts cut from a tensor read whole) are written by one rank (`assign`).
Rank 0 creates the hidden output directory, the
files (preallocated, headers written) and after everyone's share the index and companion
files; verification is split the same way (each tensor by the rank whose span holds its first
byte). The output is published by rank 0 only when every rank reported success; a rank that
fails or dies leaves nothing at the output path (torchrun stops the others; the hidden
directory is removed, or by the next merge to that path when its owner is gone).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardforge.errors import MergeError
from shardforge.formats.base import Destination, TensorSource
from shardforge.io.copy import ReadCache, copy_range, pwrite_all
from shardforge.sinks.plan import OutputPlan, PlannedFile, PlannedTensor

log = logging.getLogger("shardforge")

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Share:
    """Rows [start, stop) of one planned tensor that a rank writes."""

    file: PlannedFile
    tensor: PlannedTensor
    rows: tuple[int, int]


def _rows_of(t: PlannedTensor) -> int:
    return t.spec.shape[0] if t.spec.shape else 1


def _rank_at(pos: int, total: int, world: int) -> int:
    """The rank whose span [total * r // world, total * (r + 1) // world) holds byte `pos`
    (the last rank for a position at or past the end)."""
    rank = min(world - 1, pos * world // max(1, total))
    while rank + 1 < world and total * (rank + 1) // world <= pos:
        rank += 1
    while rank > 0 and total * rank // world > pos:
        rank -= 1
    return rank


def assign(
    plan: OutputPlan, world: int, together: Mapping[str, Hashable] | None = None
) -> list[list[Share]]:
    """Every rank's shares: the plan's tensor bytes, in plan order, cut into `world` equal
    spans, a row going to the rank whose span holds its first byte (every row written exactly
    once). The tensors of one `together` group (outputs computed from one value in memory,
    `keymap.converted.written_together`) are written whole by one rank: the rank whose span
    holds the first byte of the group's first tensor."""
    total = sum(t.spec.nbytes for _, t in plan.tensors())
    out: list[list[Share]] = [[] for _ in range(world)]
    group_rank: dict[Hashable, int] = {}
    pos = 0
    for f, t in plan.tensors():
        n, rows = t.spec.nbytes, _rows_of(t)
        key = (together or {}).get(t.spec.name)
        if key is not None:
            rank = group_rank.setdefault(key, _rank_at(pos, total, world))
            out[rank].append(Share(f, t, (0, rows)))
        elif n:
            row = n // rows
            for rank in range(_rank_at(pos, total, world), _rank_at(pos + n - 1, total, world) + 1):
                lo, hi = total * rank // world, total * (rank + 1) // world
                start = max(0, -(-(lo - pos) // row))  # first row starting at or after lo
                stop = min(rows, -(-(hi - pos) // row))  # rows starting before hi
                if start < stop:
                    out[rank].append(Share(f, t, (start, stop)))
        pos += n
    return out


def shares(
    plan: OutputPlan, rank: int, world: int, together: Mapping[str, Hashable] | None = None
) -> list[Share]:
    """Rank `rank`'s shares of `assign`."""
    return assign(plan, world, together)[rank]


def owner(
    plan: OutputPlan, world: int, together: Mapping[str, Hashable] | None = None
) -> dict[str, int]:
    """Output name -> the rank that writes its first row (it verifies the tensor)."""
    found: dict[str, int] = {}
    for rank, mine in enumerate(assign(plan, world, together)):
        for s in mine:
            if s.rows[0] == 0:
                found[s.tensor.spec.name] = rank
    total, pos = sum(t.spec.nbytes for _, t in plan.tensors()), 0
    for _, t in plan.tensors():  # empty tensors: no share holds them
        if t.spec.name not in found:
            found[t.spec.name] = _rank_at(pos, total, world)
        pos += t.spec.nbytes
    return found


def create_files(plan: OutputPlan, directory: Path) -> None:
    """Rank 0: every planned file at its full size with its header."""
    for pf in plan.files:
        fd = os.open(directory / pf.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.ftruncate(fd, pf.size)
            pwrite_all(fd, memoryview(pf.header), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


def write_shares(
    mine: list[Share],
    sources: Mapping[str, TensorSource],
    directory: Path,
    progress: Progress,
) -> None:
    """Write this rank's rows into the existing files; fsync what it wrote."""
    fds: dict[str, int] = {}
    try:
        with ReadCache() as reader:
            for s in mine:
                if s.file.name not in fds:
                    fds[s.file.name] = os.open(directory / s.file.name, os.O_WRONLY)
                fd = fds[s.file.name]
                src, spec = sources[s.tensor.spec.name], s.tensor.spec
                slabs = src.slabs(reader) if src.dtype == spec.dtype else None
                if slabs is None:
                    src.write(
                        reader, Destination(fd, s.tensor.offset, spec.dtype, progress), s.rows
                    )
                    continue
                row = spec.nbytes // _rows_of(s.tensor)
                lo, hi = s.rows[0] * row, s.rows[1] * row
                for slab in slabs:  # the slabs' bytes inside this rank's rows
                    a, b = max(lo, slab.dst_offset), min(hi, slab.dst_offset + slab.nbytes)
                    if a < b:
                        start = slab.src_offset + a - slab.dst_offset
                        copy_range(reader.fd(slab.path), fd, start, s.tensor.offset + a, b - a)
                        progress(b - a)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def gather_status(error: BaseException | None) -> list[str | None]:
    """Every rank's failure (one line) or None, on every rank."""
    mine = None if error is None else (str(error).splitlines() or [type(error).__name__])[0]
    statuses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, mine)
    return statuses


def raise_failures(statuses: list[str | None]) -> None:
    failed = [(r, m) for r, m in enumerate(statuses) if m is not None]
    if failed:
        rank, message = failed[0]
        raise MergeError(
            f"the distributed merge failed on rank {rank}: {message[:200]}; nothing was written",
            [f"rank {r}: {m[:200]}" for r, m in failed[1:]],
        )


def broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
