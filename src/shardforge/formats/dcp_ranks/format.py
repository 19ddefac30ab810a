"""The dcp-ranks row of the format registry: a DCP directory written with
``torch.distributed.checkpoint.save(..., use_collectives=False)`` (checked: torch 2.13): one
``__R.metadata`` per rank beside the ``__R_N.distcp`` files, no global ``.metadata``.

Everything but finding the metadata is the DCP row's: the entries (`rank_metadata` merges the
ranks'), the chunk records and sources (`source`: DCP's, comparing the copies several ranks
saved of a chunk), optimizer or training state refused for removal, and torch's own `dcp.load`
as the reference reader (once per rank's metadata)."""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from shardforge.formats.base import NamedSource, ReferenceReader
from shardforge.formats.dcp.format import DcpFormat
from shardforge.formats.dcp.metadata import METADATA_FILE, CheckpointMetadata
from shardforge.formats.dcp_ranks.rank_metadata import (
    RANK_METADATA,
    list_rank_metadata,
    read_rank_copies,
    read_rank_metadata,
)


class DcpRanksFormat(DcpFormat):
    name = "dcp-ranks"
    looked_for = "a DCP directory with __<R>.metadata per rank (use_collectives=False)"
    shards_described = "the __<R>.metadata files and the .distcp files they name"

    def detect(self, folder: Path) -> bool:
        return (
            folder.is_dir()
            and not os.path.lexists(folder / METADATA_FILE)
            and any(RANK_METADATA.match(p.name) for p in folder.iterdir())
        )

    def metadata(self, folder: Path) -> CheckpointMetadata:
        return read_rank_metadata(folder)

    def open(self, folder: Path) -> dict[str, NamedSource]:
        """DCP's sources, each with the copies other ranks saved of its chunks (compared
        before its bytes are used: `formats.dcp_ranks.source`)."""
        from shardforge.formats.dcp_ranks.source import DcpRanksSource

        meta, copies = self.metadata(folder), read_rank_copies(folder)
        return {
            k: NamedSource(e.path, DcpRanksSource(e, meta.directory, self.name, copies.get(k, ())))
            for k, e in meta.tensors.items()
        }

    def metadata_files(self, folder: Path) -> list[PurePath]:
        return [PurePath(p.name) for p in list_rank_metadata(folder).values()]

    def reference(self, location: Path) -> ReferenceReader:
        from shardforge.formats.dcp.pickles import load_metadata_pickle
        from shardforge.formats.dcp.reference import DcpReference

        files = list_rank_metadata(location).values()
        return DcpReference(location, [load_metadata_pickle(p, as_torch=True) for p in files])
