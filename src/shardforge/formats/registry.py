"""The format registry: open a checkpoint's model folder as named tensor sources.

    named = open_checkpoint(kind, model_dir)    # key -> NamedSource (metadata only)

`FORMATS` maps each kind (DCP, rank files) to its opener; adding a format is adding a row.
Key names are mapped afterwards (`shardforge.keymap.names`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError
from shardforge.formats.kinds import DCP, RANK_FILES
from shardforge.formats.sources import DcpSource, RankFileSource, TensorSource

log = logging.getLogger("shardforge")

# verl writes this beside its rank files: {"FSDP_version": 2, "world_size": W}
FSDP_CONFIG = "fsdp_config.json"


@dataclass(frozen=True)
class NamedSource:
    """One tensor of a checkpoint: its original path (for key mapping) and its source."""

    path: tuple[str, ...]
    source: TensorSource

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype


def _open_dcp(model_dir: Path) -> dict[str, NamedSource]:
    from shardforge.formats.dcp.metadata import read_metadata

    meta = read_metadata(model_dir)
    return {k: NamedSource(e.path, DcpSource(e, meta.directory)) for k, e in meta.tensors.items()}


def check_fsdp_config(model_dir: Path, world_size: int) -> None:
    """verl's `fsdp_config.json` beside the rank files must name their world size."""
    path = model_dir / FSDP_CONFIG
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")).get("world_size")
    except (ValueError, AttributeError, OSError):
        log.warning("%s: not readable JSON; ignored", path)
        return
    if isinstance(recorded, int) and recorded != world_size:
        raise CheckpointError(
            f"{path}: says world_size {recorded}, but {model_dir} holds the rank files of "
            f"world size {world_size}; the folder mixes runs or is incomplete"
        )


def _open_rank_files(model_dir: Path) -> dict[str, NamedSource]:
    from shardforge.formats.rankfiles.rank_file import read_rank_file
    from shardforge.formats.rankfiles.rank_plan import list_rank_files, plan_from_files

    paths = list_rank_files(model_dir)
    check_fsdp_config(model_dir, len(paths))
    plans = plan_from_files([read_rank_file(p) for p in paths.values()])
    return {k: NamedSource((k,), RankFileSource(p)) for k, p in plans.items()}


FORMATS: dict[str, Callable[[Path], dict[str, NamedSource]]] = {
    DCP: _open_dcp,
    RANK_FILES: _open_rank_files,
}


def open_checkpoint(kind: str, model_dir: Path) -> dict[str, NamedSource]:
    """Every tensor of a model folder of `kind` (nothing but metadata is read)."""
    opener = FORMATS.get(kind)
    if opener is None:
        raise CheckpointError(f"{model_dir}: unknown checkpoint kind {kind!r}")
    return opener(model_dir)
