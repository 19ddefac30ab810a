"""Where DCP's safetensors storage keeps its files (torch-free: finding a checkpoint runs
before torch is imported): the shard files ``shard-<S>-model-<K>-of-<N>.safetensors`` (S = rank
+ 1) in the folder itself or, when consolidated, in its ``sharded/``."""

from __future__ import annotations

import re
from pathlib import Path

from shardforge.errors import CheckpointError

# the name of this format (`formats.dcp_safetensors.format.DcpSafetensorsFormat.name`)
DCP_SAFETENSORS = "dcp-safetensors"
SHARD_FILE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARD_SHOWN = "shard-<S>-model-<K>-of-<N>.safetensors"
SHARDED_DIR = "sharded"
INDEX = "model.safetensors.index.json"


def has_shards(folder: Path) -> bool:
    """Whether `folder` holds shard files (names only)."""
    return folder.is_dir() and any(SHARD_FILE.match(p.name) for p in folder.iterdir())


def shards_dir(folder: Path) -> Path | None:
    """Where the shard files of `folder` are: itself, or its `sharded/` (None: neither)."""
    if has_shards(folder):
        return folder
    sub = folder / SHARDED_DIR
    return sub if not sub.is_symlink() and has_shards(sub) else None


def list_shards(folder: Path) -> list[Path]:
    """The shard files of `folder`, by shard number then file number: one save (one N), shard
    numbers 1 .. S without a gap."""
    found: dict[tuple[int, int], Path] = {}
    totals: set[int] = set()
    for p in sorted(folder.iterdir()):
        m = SHARD_FILE.match(p.name)
        if m and p.is_file():
            found[(int(m.group(1)), int(m.group(2)))] = p
            totals.add(int(m.group(3)))
    if not found:
        raise CheckpointError(f"{folder}: no {SHARD_SHOWN} files")
    if len(totals) > 1:
        listed = ", ".join(f"-of-{n:05d}" for n in sorted(totals))
        raise CheckpointError(
            f"{folder}: shard files of different saves ({listed}) are mixed in one folder; "
            "keep only the files of one save"
        )
    shards = {s for s, _ in found}
    missing = sorted(set(range(1, max(shards) + 1)) - shards)
    if missing or min(shards) < 1:
        first = missing[0] if missing else min(shards)
        raise CheckpointError(
            f"{folder}: no file of shard {first:05d} (rank {first - 1}); the save is incomplete "
            "or mixes runs"
        )
    return [found[k] for k in sorted(found)]


def world_size(folder: Path) -> int:
    """How many ranks wrote the shard files of `folder`."""
    return len({m.group(1) for p in list_shards(folder) if (m := SHARD_FILE.match(p.name))})
