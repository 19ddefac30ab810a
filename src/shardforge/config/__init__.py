"""The YAML config: schema, loading, overrides and error reporting.

``load_cfg(path, **overrides)`` returns the validated, read-only `ShardforgeConfig`.
"""

from shardforge.config.dict_default import DictDefault
from shardforge.config.loader import (
    ConfigLike,
    coerce_cfg,
    load_cfg,
    parse_override_args,
    validate_cfg,
)
from shardforge.config.schema import DatasetConfig, FsdpConfig, ShardforgeConfig
from shardforge.config.view import ConfigReadOnlyError

__all__ = [
    "ConfigLike",
    "ConfigReadOnlyError",
    "DatasetConfig",
    "DictDefault",
    "FsdpConfig",
    "ShardforgeConfig",
    "coerce_cfg",
    "load_cfg",
    "parse_override_args",
    "validate_cfg",
]
