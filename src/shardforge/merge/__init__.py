"""The merge: locate -> open -> map keys -> check -> plan -> write -> verify -> publish.

`merge_fsdp_weights` is imported on first use: the merge's head start (`merge.overlap`) runs
from torch-free modules of this package before torch is imported.
"""

from typing import Any

__all__ = ["merge_fsdp_weights"]


def __getattr__(name: str) -> Any:
    if name == "merge_fsdp_weights":
        from shardforge.merge.api import merge_fsdp_weights

        return merge_fsdp_weights
    raise AttributeError(f"module 'shardforge.merge' has no attribute {name!r}")
