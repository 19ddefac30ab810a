"""DCP's independent reader for `--verify`: torch's own `dcp.load` (no_dist), fed the metadata
that the allow-list unpickler read once (`.metadata`, or each rank's own metadata file of a
collective-free save, one `dcp.load` per rank)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import MergeError, printable
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.reference import check_zip_crcs, short_reason, torch_quiet, verify_failed


class DcpReference(ReferenceReader):
    """One DCP directory read by torch's `dcp.load`, with its metadata (`metadata`: one per
    rank where the ranks saved their own; default: `.metadata`) read once through the
    allow-list unpickler."""

    def __init__(self, directory: Path, metadata: Sequence[Any] | None = None) -> None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from shardforge.formats.dcp.reader import read_dcp_metadata

        self.directory = directory
        self.metadata = list(metadata) if metadata is not None else [read_dcp_metadata(directory)]
        for meta in self.metadata:
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()

    def _reader(self, metadata: Any) -> Any:
        """torch's FileSystemReader (through `SafeFileSystemReader`), or its FsspecReader for a
        checkpoint in object storage, handed the metadata read once (instead of re-reading it
        for every batch)."""
        from shardforge.formats.dcp.reader import SafeFileSystemReader
        from shardforge.io.mirror import remote_location

        remote = remote_location(self.directory)
        base: type[Any] = SafeFileSystemReader
        args: tuple[Any, ...] = (str(self.directory),)
        options: dict[str, Any] = {}
        if remote is not None:  # torch's own fsspec reader, never the stand-ins' bytes path
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            base, args, options = FsspecReader, (str(remote[0]),), dict(remote[1] or {})

        class _ReadOnce(base):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                assert metadata.storage_meta is not None  # set in __init__
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return _ReadOnce(*args, **options)

    def check_crcs(self, keys: set[str]) -> None:
        per_file: dict[str, list[tuple[int, int]]] = {}
        for meta in self.metadata:
            for index, info in meta.storage_data.items():
                if index.fqn in keys:
                    per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        for relative, windows in sorted(per_file.items()):
            check_zip_crcs(self.directory / relative, self.directory, sorted(set(windows)))

    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        state = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in wanted}
        for meta in self.metadata:
            part = {k: t for k, t in state.items() if k in meta.state_dict_metadata}
            if not part:
                continue
            try:
                with torch_quiet():
                    dcp.load(
                        part,
                        storage_reader=self._reader(meta),
                        planner=DefaultLoadPlanner(),
                        no_dist=True,
                    )
            except Exception as exc:
                raise MergeError(
                    "verification failed: torch's DCP reader cannot read "
                    f"{printable(', '.join(part)[:200])} from {self.directory} "
                    f"({short_reason(exc)})"
                ) from None
        if len(self.metadata) > 1:
            self._check_covered(state)
        return state

    def _check_covered(self, state: dict[str, torch.Tensor]) -> None:
        """Each tensor is covered by the ranks' distinct chunks (per-rank metadata only: one
        `.metadata` describes whole tensors to torch's reader)."""
        for key, full in state.items():
            boxes = {
                (tuple(c.offsets), tuple(c.sizes))
                for meta in self.metadata
                if (entry := meta.state_dict_metadata.get(key)) is not None
                for c in getattr(entry, "chunks", ())
            }
            covered = sum(math.prod(sizes) for _, sizes in boxes)
            if covered != full.numel():
                raise verify_failed(
                    key,
                    self.directory,
                    f"is covered by {covered} of {full.numel()} elements for torch's DCP reader",
                )
