"""shardforge: config-first FSDP2 training and streaming merges of sharded checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardforge.version import __version__

__all__ = ["__version__", "load_cfg", "merge_fsdp_weights"]

if TYPE_CHECKING:
    from shardforge.config import load_cfg
    from shardforge.merge.api import merge_fsdp_weights


def __getattr__(name: str) -> Any:
    # Lazy exports keep `import shardforge` (and the CLI's --help) free of torch imports.
    if name == "load_cfg":
        from shardforge.config import load_cfg

        return load_cfg
    if name == "merge_fsdp_weights":
        from shardforge.merge.api import merge_fsdp_weights

        return merge_fsdp_weights
    raise AttributeError(f"module 'shardforge' has no attribute {name!r}")
