"""A tensor spread over per-rank DTensor files as a `TensorSource`: zero-copy slabs where the
pieces tile the tensor in C order, else assembled in memory (one tensor)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.formats.base import Described, StoredTensor
from shardforge.formats.sources import WholeTensor
from shardforge.io.copy import FileSlab, ReadCache

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
        return [FileSlab(s.path, s.src_offset, s.nbytes, s.dst_offset) for s in slabs]

    def read(self, reader: ReadCache) -> torch.Tensor:
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
        return (StoredTensor(self.fmt, directory, tp.key, tp.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]
