"""shardforge's own `trainer_state.json`, the file `shardforge train` writes into each
checkpoint (step, world size, data position, the base model's stored dtype, versions): its one
reader. Training resumes from it (`train.checkpointing.TrainerState`); the merge reads the
dtype it recorded (`merge.locate.recorded_dtype`); the layouts catalog knows a shardforge step
by it (the layout's marker)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError
from shardforge.io.files import read_json

STATE_FILE = "trainer_state.json"
FORMAT = "shardforge"
FORMAT_VERSION = 1


def read_state(step_dir: Path) -> dict[str, Any]:
    """The trainer state of the checkpoint folder `step_dir` (its size capped, read as
    untrusted JSON); CheckpointError naming the file when it is missing, not JSON, or not a
    shardforge v1 trainer state."""
    path = step_dir / STATE_FILE
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or data.get("format_version") != FORMAT_VERSION
    ):
        raise CheckpointError(f"{path}: not a shardforge v1 trainer state")
    return data
