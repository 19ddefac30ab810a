"""torch's DCP `FileSystemReader` with `.metadata` read through the allow-list unpickler.

torch's own reader uses plain `pickle.load` on `.metadata`, which runs whatever the file names.
Every place that hands a checkpoint to `dcp.load` (resume in `train`, `--engine transformers`
in the merge) uses this reader instead: the metadata is parsed into plain records by
`shardforge.io.unpickler` and torch's dataclasses are then built from checked fields; tensor
records are read by torch with `weights_only`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import METADATA_FILE
from shardforge.io.unpickler import load_metadata_pickle


def read_dcp_metadata(directory: str | Path) -> Metadata:
    """The `Metadata` (torch's classes) of a DCP directory, through the allow-list."""
    path = Path(directory) / METADATA_FILE
    metadata = load_metadata_pickle(path, as_torch=True)
    if not isinstance(metadata, Metadata):  # internal: to_torch_metadata builds one or refuses
        raise CheckpointError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(str(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
