"""The names of per-rank files (torch-free: finding a checkpoint runs before torch is imported)."""

from __future__ import annotations

import re
from pathlib import Path

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


def parse_rank_name(path: Path) -> tuple[int, int] | None:
    """(world_size, rank) from ``model_world_size_W_rank_R.pt``; None for other names."""
    m = RANK_FILE.match(path.name)
    return (int(m.group(1)), int(m.group(2))) if m else None
