"""The YAML config: schema, loading, overrides and error reporting."""

from shardforge.config.loader import (
    DictDefault,
    coerce_cfg,
    load_cfg,
    parse_override_args,
    to_view,
    validate_cfg,
)
from shardforge.config.schema import DatasetConfig, FsdpConfig, ShardforgeConfig

__all__ = [
    "DatasetConfig",
    "DictDefault",
    "FsdpConfig",
    "ShardforgeConfig",
    "coerce_cfg",
    "load_cfg",
    "parse_override_args",
    "to_view",
    "validate_cfg",
]
