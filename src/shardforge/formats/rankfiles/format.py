"""The rank-files row of the format registry: one ``model_world_size_W_rank_R.pt`` per rank
(`torch.save` of the rank's FSDP2 DTensor state dict), as verl and LMMs-Engine write them."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path, PurePath
from typing import ClassVar

from shardforge.errors import CheckpointError
from shardforge.formats.base import (
    CheckpointFormat,
    Contents,
    NamedSource,
    ReferenceReader,
    SourceFile,
    StateSummary,
    StoredRecord,
)
from shardforge.formats.rankfiles.names import RANK_NAMES, RankNames
from shardforge.io.files import read_json

log = logging.getLogger("shardforge")

# verl writes this beside its rank files: {"FSDP_version": 2, "world_size": W}
FSDP_CONFIG = "fsdp_config.json"
# per-rank optimizer / extra state files written beside the model rank files (verl); never read
RANK_STATE_FILES: dict[str, re.Pattern[str]] = {
    "optimizer": re.compile(r"^optim_world_size_(\d+)_rank_(\d+)\.pt$"),
    "other": re.compile(r"^extra_state_world_size_(\d+)_rank_(\d+)\.pt$"),
}


def check_fsdp_config(model_dir: Path, world_size: int) -> None:
    """verl's `fsdp_config.json` beside the rank files must name their world size."""
    path = model_dir / FSDP_CONFIG
    if not path.is_file():
        return
    try:
        recorded = read_json(path, model_dir).get("world_size")
    except (CheckpointError, AttributeError) as exc:
        log.warning("%s: not readable JSON; ignored (%s)", path, exc)
        return
    if isinstance(recorded, int) and recorded != world_size:
        raise CheckpointError(
            f"{path}: says world_size {recorded}, but {model_dir} holds the rank files of "
            f"world size {world_size}; the folder mixes runs or is incomplete"
        )


def _rank_state(rank_dir: Path, pattern: re.Pattern[str] | None) -> StateSummary | None:
    """The per-rank state files matching `pattern` beside the model's (counted, never read)."""
    if pattern is None:
        return None
    files = [p for p in sorted(rank_dir.iterdir()) if pattern.match(p.name) and p.is_file()]
    if not files:
        return None
    return StateSummary(
        location="files",
        path=str(rank_dir),
        tensor_count=None,
        non_tensor_count=None,
        total_bytes=None,
        files=len(files),
        files_bytes=sum(p.stat().st_size for p in files),
    )


class RankFilesFormat(CheckpointFormat):
    """Per-rank DTensor files named as `names` says; a format naming its files otherwise (and
    keeping its optimizer files under other names) is a subclass setting the class facts."""

    name = "rank-files"
    looked_for = "a folder of model_world_size_W_rank_R.pt files"
    shards_described = "the model_world_size_W_rank_R.pt files"
    # how the model files are named
    names: ClassVar[RankNames] = RANK_NAMES
    # per-rank optimizer ("optimizer") and other training state ("other") files beside them
    state_files: ClassVar[dict[str, re.Pattern[str]]] = RANK_STATE_FILES

    def detect(self, folder: Path) -> bool:
        return folder.is_dir() and any(self.names.parse(p) for p in folder.iterdir())

    def open(self, folder: Path) -> dict[str, NamedSource]:
        from shardforge.formats.rankfiles.rank_plan import plan_from_files, read_rank_files
        from shardforge.formats.rankfiles.source import RankFileSource

        files = read_rank_files(folder, self.names)
        check_fsdp_config(folder, len(files))
        plans = plan_from_files(files)
        return {k: NamedSource((k,), RankFileSource(p, self.name)) for k, p in plans.items()}

    def describe(self, folder: Path) -> Contents:
        """Tensors (metadata only); optimizer files beside them are counted, not read."""
        from shardforge.formats.rankfiles.rank_plan import plan_from_files, read_rank_files

        files = read_rank_files(folder, self.names)
        return Contents.of_rank_files(
            self.name,
            plan_from_files(files),
            len(files),
            self.names.shown,
            optimizer=_rank_state(folder, self.state_files.get("optimizer")),
            other_state=_rank_state(folder, self.state_files.get("other")),
        )

    def shard_files(self, folder: Path) -> list[PurePath]:
        from shardforge.formats.rankfiles.rank_plan import list_rank_files

        return [PurePath(p.name) for p in list_rank_files(folder, self.names).values()]

    def reference(self, location: Path) -> ReferenceReader:
        from shardforge.formats.rankfiles.reference import RankFilesReference

        return RankFilesReference(location, self.names)

    def identity(self, location: Path) -> list[SourceFile]:
        """Every rank file: one zip record, with the CRC-32 stored for each of its members
        (its pickle and every storage)."""
        from shardforge.formats.rankfiles.rank_plan import list_rank_files
        from shardforge.io.files import open_regular
        from shardforge.io.zip_record import read_zip_record

        out = []
        for path in list_rank_files(location, self.names).values():
            fd = open_regular(path, location)
            try:
                size = os.fstat(fd).st_size
                members = read_zip_record(fd, 0, size, str(path)).members
            finally:
                os.close(fd)
            crcs = tuple(sorted((name, m.crc32) for name, m in members.items()))
            out.append(SourceFile(PurePath(path.name), size, (StoredRecord(0, size, crcs),)))
        return out
