"""DCP's independent reader for `--verify`: torch's own `dcp.load` (no_dist), fed the `.metadata`
that the allow-list unpickler read once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import MergeError, printable
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.reference import check_zip_crcs, short_reason, torch_quiet


class DcpReference(ReferenceReader):
    """One DCP directory read by torch's `dcp.load`, with the `.metadata` read once through
    the allow-list unpickler."""

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from shardforge.formats.dcp.reader import read_dcp_metadata

        self.directory = directory
        self.metadata = read_dcp_metadata(directory)
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()

    def _reader(self) -> Any:
        """torch's FileSystemReader (through `SafeFileSystemReader`), or its FsspecReader for a
        checkpoint in object storage, handed the metadata read once (instead of re-reading
        `.metadata` for every batch)."""
        from shardforge.formats.dcp.reader import SafeFileSystemReader
        from shardforge.io.mirror import remote_location

        metadata = self.metadata
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
        for index, info in self.metadata.storage_data.items():
            if index.fqn in keys:
                per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        for relative, windows in sorted(per_file.items()):
            check_zip_crcs(self.directory / relative, self.directory, windows)

    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        state = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in wanted}
        try:
            with torch_quiet():
                dcp.load(
                    state,
                    storage_reader=self._reader(),
                    planner=DefaultLoadPlanner(),
                    no_dist=True,
                )
        except Exception as exc:
            raise MergeError(
                "verification failed: torch's DCP reader cannot read "
                f"{printable(', '.join(state)[:200])} from {self.directory} ({short_reason(exc)})"
            ) from None
        return state
