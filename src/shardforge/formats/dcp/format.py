"""The DCP row of the format registry: a torch.distributed.checkpoint directory (`.metadata` +
`__R_N.distcp` records), as written by torch DCP, accelerate, HF Trainer, torchtitan, Lightning
and shardforge's own training."""

from __future__ import annotations

import re
from pathlib import Path, PurePath

from shardforge.errors import MergeError
from shardforge.formats.base import (
    NOT_REMOVED,
    CheckpointFormat,
    Contents,
    NamedSource,
    ReferenceReader,
    SourceFile,
    StateSummary,
    StoredRecord,
    TensorFact,
)
from shardforge.formats.dcp.metadata import METADATA_FILE, CheckpointMetadata, read_metadata
from shardforge.formats.state import state_kind
from shardforge.io.copy import ReadCache

DISTCP_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def state_summary(meta: CheckpointMetadata, keys: list[str], location: str) -> StateSummary | None:
    """How much of `meta` the entries `keys` hold (None: none)."""
    if not keys:
        return None
    tensors = [meta.tensors[k] for k in keys if k in meta.tensors]
    return StateSummary(
        location=location,
        path=str(meta.directory),
        tensor_count=len(tensors),
        non_tensor_count=sum(1 for k in keys if k not in meta.tensors),
        total_bytes=sum(t.nbytes for t in tensors),
        files=0,
        files_bytes=None,
    )


def _by_kind(meta: CheckpointMetadata) -> tuple[dict[str, list[str]], list[str]]:
    """Tensor and non-tensor keys by what they are; the model's non-tensor keys apart."""
    by_kind: dict[str, list[str]] = {"model": [], "optimizer": [], "training": []}
    for key, entry in meta.tensors.items():
        by_kind[state_kind(entry.path)].append(key)
    model_non_tensor: list[str] = []
    for key in meta.non_tensor_keys:
        kind = state_kind((key,))
        (model_non_tensor if kind == "model" else by_kind[kind]).append(key)
    return by_kind, model_non_tensor


class DcpFormat(CheckpointFormat):
    """A DCP directory; a DCP whose metadata is stored otherwise (per rank) is a subclass
    with its own `detect`, `metadata`, `metadata_files` and `reference`."""

    name = "dcp"
    looked_for = "a DCP directory with .metadata"
    shards_described = "the .metadata file and the .distcp files it names"

    def detect(self, folder: Path) -> bool:
        return (folder / METADATA_FILE).is_file()

    def metadata(self, folder: Path) -> CheckpointMetadata:
        """Every entry of the checkpoint, checked (paths, tiling, byte ranges)."""
        return read_metadata(folder)

    def metadata_files(self, folder: Path) -> list[PurePath]:
        """The metadata files, relative to `folder` (removed with the shards)."""
        return [PurePath(METADATA_FILE)]

    def open(self, folder: Path) -> dict[str, NamedSource]:
        from shardforge.formats.dcp.source import DcpSource

        meta = self.metadata(folder)
        return {
            k: NamedSource(e.path, DcpSource(e, meta.directory, self.name))
            for k, e in meta.tensors.items()
        }

    def describe(self, folder: Path) -> Contents:
        """Model tensors, optimizer and other training state mixed in (state beside the
        folder is the layout's: `shardforge.inspection`)."""
        meta = self.metadata(folder)
        by_kind, model_non_tensor = _by_kind(meta)
        tensors = tuple(TensorFact.of(k, meta.tensors[k]) for k in by_kind["model"])
        ranks = {int(m.group(1)) for p in folder.iterdir() if (m := DISTCP_FILE.match(p.name))}
        return Contents(
            storage=self.name,
            tensors=tensors,
            non_tensor_keys=tuple(model_non_tensor),
            world_size=len(ranks) if ranks else None,
            world_size_source="__R_N.distcp file names" if ranks else None,
            optimizer=state_summary(meta, by_kind["optimizer"], "mixed"),
            other_state=state_summary(meta, by_kind["training"], "mixed"),
            versions={"dcp_metadata": meta.version} if meta.version else {},
        )

    def shard_files(self, folder: Path) -> list[PurePath]:
        """The metadata and every data file its entries name; refused when an entry is
        optimizer or other training state (it lives in the same files)."""
        meta = self.metadata(folder)
        by_kind, _ = _by_kind(meta)
        found = {kind: keys for kind, keys in by_kind.items() if kind != "model" and keys}
        if found:
            what = " and ".join(
                f"{'optimizer' if kind == 'optimizer' else 'training'} state ({keys[0]}, ...)"
                for kind, keys in sorted(found.items())
            )
            raise MergeError(
                f"{folder} holds {what} in the same files as the model weights; removing the "
                f"shards would delete it - {NOT_REMOVED}"
            )
        files = {c.file for e in meta.tensors.values() for c in e.chunks}
        data = sorted(PurePath(f.relative_to(meta.directory)) for f in files)
        return [*self.metadata_files(folder), *data]

    def reference(self, location: Path) -> ReferenceReader:
        from shardforge.formats.dcp.reference import DcpReference

        return DcpReference(location)

    def identity(self, location: Path) -> list[SourceFile]:
        """The metadata files and the data files of the model's entries, with each chunk
        record's byte range and the CRC-32 stored for its tensor bytes (records parsed once
        per merge)."""
        from shardforge.formats.dcp.chunks import locate

        meta = self.metadata(location)
        by_kind, _ = _by_kind(meta)
        records: dict[Path, set[StoredRecord]] = {}
        with ReadCache() as reader:
            for key in by_kind["model"]:
                for c in meta.tensors[key].chunks:
                    _, raw = locate(reader, c)
                    crc = () if raw is None else ((raw.storage.name, raw.storage.crc32),)
                    records.setdefault(c.file, set()).add(
                        StoredRecord(c.byte_offset, c.byte_length, crc)
                    )
        files = [
            SourceFile(p, (location / p).stat().st_size) for p in self.metadata_files(location)
        ]
        for path in sorted(records):
            recs = tuple(sorted(records[path], key=lambda r: r.offset))
            files.append(
                SourceFile(PurePath(path.relative_to(meta.directory)), path.stat().st_size, recs)
            )
        return files
