"""Per-rank DTensor state-dict files (``model_world_size_W_rank_R.pt``, LMMs-Engine FSDP2, verl):
safe reading and assembly planning of full tensors (step discovery: shardforge.layouts).

The names below are imported on first use: this package is imported torch-free (`names`,
`format`) when a checkpoint is found, before torch is.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Piece": "rank_plan",
    "TensorPlan": "rank_plan",
    "plan_rank_files": "rank_plan",
    "RankFile": "rank_file",
    "TensorRecord": "rank_file",
    "read_rank_file": "rank_file",
    "Placement": "pickles",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
