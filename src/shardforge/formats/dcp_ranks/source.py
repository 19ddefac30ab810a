"""A tensor of a collective-free DCP save as a `TensorSource`: DCP's source, whose chunks that
several ranks saved (a replicated tensor: without collectives every rank writes its copy) are
read from the lowest rank and, before any of the tensor's bytes are used, compared with every
other rank's copy, byte for byte in bounded blocks (once per command: `ReadCache.fact`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.base import Destination, Rows
from shardforge.formats.dcp.chunks import locate, read
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.dcp_ranks.rank_metadata import Copy
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.dtypes import dtype_name
from shardforge.io.files import read_exact_into

# copies of a chunk are compared in blocks of this many bytes
COMPARE_BLOCK = 4 << 20


@dataclass(frozen=True)
class DcpRanksSource(DcpSource):
    """A DCP tensor with the copies other ranks saved of its chunks (`rank_metadata.Copy`)."""

    copies: tuple[Copy, ...] = ()

    def check_copies(self, reader: ReadCache) -> None:
        """Every copy equals the chunk that is read; a `CheckpointError` naming the tensor and
        the two ranks otherwise."""
        if self.copies:
            what = ("dcp-rank-copies", self.entry.key)
            reader.fact(self.copies[0].chunk.file, what, lambda _: self._compare(reader))

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        self.check_copies(reader)
        return super().slabs(reader)

    def read(self, reader: ReadCache) -> torch.Tensor:
        self.check_copies(reader)
        return super().read(reader)

    def write(self, reader: ReadCache, dest: Destination, rows: Rows | None = None) -> None:
        self.check_copies(reader)
        super().write(reader, dest, rows)

    def _compare(self, reader: ReadCache) -> bool:
        for copy in self.copies:
            if not _same(reader, copy):
                raise CheckpointError(
                    f"{copy.chunk.file.parent}: tensor {self.entry.key!r} differs between ranks "
                    f"{copy.kept_rank} and {copy.rank}; every rank saved it whole, so the copies "
                    "must be equal: a data file is damaged or comes from another save"
                )
        return True


def _same(reader: ReadCache, copy: Copy) -> bool:
    """Whether the two chunks hold the same bytes: streamed in blocks where both are stored
    contiguously in one dtype, else as two tensors."""
    fd_a, a = locate(reader, copy.kept)
    fd_b, b = locate(reader, copy.chunk)
    if a is None or b is None or not (a.contiguous and b.contiguous):
        kept, other = read(reader, copy.kept), read(reader, copy.chunk)
        return kept.dtype == other.dtype and torch.equal(_bytes(kept), _bytes(other))
    if dtype_name(a.dtype) != dtype_name(b.dtype):
        return False
    total = copy.kept.numel * a.dtype.itemsize
    x, y = bytearray(min(COMPARE_BLOCK, total)), bytearray(min(COMPARE_BLOCK, total))
    for done in range(0, total, COMPARE_BLOCK):
        n = min(COMPARE_BLOCK, total - done)
        read_exact_into(fd_a, memoryview(x)[:n], a.data_offset + done, str(copy.kept.file))
        read_exact_into(fd_b, memoryview(y)[:n], b.data_offset + done, str(copy.chunk.file))
        if x[:n] != y[:n]:
            return False
    return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
