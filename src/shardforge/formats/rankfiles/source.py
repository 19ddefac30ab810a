"""A tensor spread over per-rank DTensor files as a `TensorSource`: zero-copy slabs where the
pieces are whole rows of the tensor, else assembled in memory (one tensor). Before its bytes
are used, every copy other ranks hold of a piece (a replicated tensor) is compared with the
piece, byte for byte, in bounded blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.base import Described, StoredTensor
from shardforge.formats.sources import WholeTensor
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.files import read_exact_into

# copies of a replicated piece are compared in blocks of this many bytes
COMPARE_BLOCK = 4 << 20

# the name of this format (`formats.rankfiles.format.RankFilesFormat.name`)
RANK_FILES = "rank-files"


@dataclass(frozen=True)
class RankFileSource(Described, WholeTensor):
    """A tensor assembled from per-rank DTensor files (`shardforge.formats.rankfiles.TensorPlan`)."""

    plan: Any  # rankfiles.TensorPlan (imported lazily: the DCP path never loads rankfiles)
    fmt: str = RANK_FILES  # the registry row that reads these files (`StoredTensor.fmt`)

    @property
    def described(self) -> Any:
        return self.plan

    @property
    def path(self) -> tuple[str, ...]:
        return (self.plan.key,)

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        slabs = self.plan.slabs()
        if slabs is None:
            return None
        self.check_copies(reader)
        return [FileSlab(s.path, s.src_offset, s.nbytes, s.dst_offset) for s in slabs]

    def read(self, reader: ReadCache) -> torch.Tensor:
        from shardforge.formats.rankfiles.rank_file import read_local

        self.check_copies(reader)
        tp = self.plan
        out = torch.empty(tp.shape, dtype=tp.dtype)
        for piece in tp.pieces:
            rec, boxes = piece.record, piece.blocks()
            fd = reader.fd(rec.path)
            if len(boxes) == 1:  # an ordinary shard: straight into its region when contiguous
                region = _box(out, boxes[0][0], boxes[0][2])
                if region.is_contiguous():
                    read_local(fd, rec, out=region)
                else:
                    region.copy_(read_local(fd, rec))
                continue
            local = read_local(fd, rec)
            for start, local_start, sizes in boxes:
                _box(out, start, sizes).copy_(_box(local, local_start, sizes))
        return out

    def check_copies(self, reader: ReadCache) -> None:
        """Every copy of a piece other ranks hold equals it, byte for byte (once per cache)."""
        tp = self.plan
        if tp.copies:
            path = tp.copies[0][0].record.path
            reader.fact(path, ("rank-copies", tp.key), lambda _: _compare_copies(tp, reader))

    def stored(self) -> tuple[StoredTensor, ...]:
        tp = self.plan
        directory = tp.pieces[0].record.path.parent
        return (StoredTensor(self.fmt, directory, tp.key, tp.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]


def _box(t: torch.Tensor, start: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (first, n) in enumerate(zip(start, sizes, strict=True)):
        if n != t.shape[dim]:
            t = t.narrow(dim, first, n)
    return t


def _compare_copies(plan: Any, reader: ReadCache) -> None:
    from shardforge.formats.rankfiles.rank_file import read_local

    for copy, piece in plan.copies:
        a, b = piece.record, copy.record
        if a.contiguous and b.contiguous:
            same = _same_bytes(reader, a, b)
        else:
            x, y = read_local(reader.fd(a.path), a), read_local(reader.fd(b.path), b)
            same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not same:
            where = "replicated over the mesh" if plan.placements else "saved by every rank"
            raise CheckpointError(
                f"{a.path.parent}: tensor {plan.key!r} differs between ranks {piece.rank} and "
                f"{copy.rank}; it is {where}, so every copy must be equal: a rank file is "
                "damaged or comes from another run"
            )


def _same_bytes(reader: ReadCache, a: Any, b: Any) -> bool:
    """Whether two contiguous local tensors hold the same bytes (read in bounded blocks)."""
    itemsize = a.dtype.itemsize
    total = a.local_numel * itemsize
    starts = (
        a.data_offset + a.storage_offset * itemsize,
        b.data_offset + b.storage_offset * itemsize,
    )
    x, y = bytearray(min(COMPARE_BLOCK, total)), bytearray(min(COMPARE_BLOCK, total))
    for done in range(0, total, COMPARE_BLOCK):
        n = min(COMPARE_BLOCK, total - done)
        read_exact_into(reader.fd(a.path), memoryview(x)[:n], starts[0] + done, str(a.path))
        read_exact_into(reader.fd(b.path), memoryview(y)[:n], starts[1] + done, str(b.path))
        if x[:n] != y[:n]:
            return False
    return True
