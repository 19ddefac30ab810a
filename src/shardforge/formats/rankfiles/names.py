"""The names of per-rank files (torch-free: finding a checkpoint runs before torch is imported).

A format of per-rank DTensor files is told apart by how it names them: verl and LMMs-Engine
write ``model_world_size_W_rank_R.pt`` (`RANK_NAMES`), accelerate ``pytorch_model_fsdp_0_rank
R.bin`` (`formats.accelerate_bin`). `RankNames` says which; the listing, the planner and the
reference reader take it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RankNames:
    """How one format names its per-rank model files: `pattern` has a group `rank` (and
    `world`, the world size, where the name holds it); `template` formats a name back
    (``{world}``, ``{rank}``)."""

    pattern: re.Pattern[str]
    template: str

    @property
    def shown(self) -> str:
        """The name with <W> and <R> standing for the numbers (for messages)."""
        return self.template.format(world="<W>", rank="<R>")

    def parse(self, path: Path) -> tuple[int | None, int] | None:
        """(world size or None, rank) from a file name of this format; None for other names."""
        m = self.pattern.match(path.name)
        if m is None:
            return None
        world = m.groupdict().get("world")
        return (int(world) if world is not None else None), int(m.group("rank"))

    def file(self, world: int, rank: int) -> str:
        return self.template.format(world=world, rank=rank)


RANK_NAMES = RankNames(
    re.compile(r"^model_world_size_(?P<world>\d+)_rank_(?P<rank>\d+)\.pt$"),
    "model_world_size_{world}_rank_{rank}.pt",
)
RANK_FILE = RANK_NAMES.pattern


def parse_rank_name(path: Path) -> tuple[int, int] | None:
    """(world_size, rank) from ``model_world_size_W_rank_R.pt``; None for other names."""
    m = RANK_FILE.match(path.name)
    return (int(m.group("world")), int(m.group("rank"))) if m else None
