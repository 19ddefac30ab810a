"""The format registry: one row per checkpoint format (`formats.base.CheckpointFormat`).

    fmt = detect(folder)                 # the format whose `detect` recognises the folder, or None
    named = format_named(name).open(folder)    # key -> NamedSource (metadata only)

Adding a format is adding its folder under `shardforge.formats` and one row to `FORMATS`; the
contract test (tests/formats/test_contract.py) runs every row. Torch-free: each row imports its
readers when it is used.
"""

from __future__ import annotations

from pathlib import Path

from shardforge.errors import CheckpointError
from shardforge.formats.accelerate_bin.format import AccelerateBinFormat
from shardforge.formats.base import CheckpointFormat, NamedSource
from shardforge.formats.dcp.format import DcpFormat
from shardforge.formats.dcp_ranks.format import DcpRanksFormat
from shardforge.formats.dcp_safetensors.format import DcpSafetensorsFormat
from shardforge.formats.rankfiles.format import RankFilesFormat
from shardforge.formats.safetensors.format import SafetensorsFormat

# in `detect` order: the DCP safetensors folder (its consolidated form holds an HF index) before
# the plain safetensors directory
FORMATS: tuple[CheckpointFormat, ...] = (
    DcpFormat(),
    DcpRanksFormat(),
    RankFilesFormat(),
    AccelerateBinFormat(),
    DcpSafetensorsFormat(),
    SafetensorsFormat(),
)
_BY_NAME: dict[str, CheckpointFormat] = {f.name: f for f in FORMATS}
assert len(_BY_NAME) == len(FORMATS), "two formats share a name"

# the names layouts use for the sharded formats
DCP = DcpFormat.name
DCP_RANKS = DcpRanksFormat.name
RANK_FILES = RankFilesFormat.name
ACCELERATE_BIN = AccelerateBinFormat.name
DCP_SAFETENSORS = DcpSafetensorsFormat.name


def format_named(name: str) -> CheckpointFormat:
    fmt = _BY_NAME.get(name)
    if fmt is None:
        raise CheckpointError(f"unknown checkpoint format {name!r}; known: {', '.join(_BY_NAME)}")
    return fmt


def detect(folder: Path, sharded_only: bool = True) -> CheckpointFormat | None:
    """The first format (in `FORMATS` order) that recognises `folder`; sharded checkpoint
    formats only unless `sharded_only` is False."""
    if not folder.is_dir():
        return None
    for fmt in FORMATS:
        if (fmt.sharded or not sharded_only) and fmt.detect(folder):
            return fmt
    return None


def open_checkpoint(name: str, model_dir: Path) -> dict[str, NamedSource]:
    """Every tensor of a model folder of format `name` (nothing but metadata is read)."""
    return format_named(name).open(model_dir)


def looked_for() -> list[str]:
    """What a sharded checkpoint folder holds, per format (for errors)."""
    return [f.looked_for for f in FORMATS if f.sharded]
