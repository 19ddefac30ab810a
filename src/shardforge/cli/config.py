"""Axolotl's `axolotl.cli.config`, for scripts written against it:

    from shardforge.cli.config import load_cfg
    from shardforge.cli.merge_sharded_fsdp_weights import merge_fsdp_weights

    cfg = load_cfg("examples/llama-3/fft-8b.yaml")
    merge_fsdp_weights(cfg, output_path="./merged_model", save_tokenizer=True)

`load_cfg` returns the config as written, with the keyword overrides applied (a nested key as
Axolotl spells it, `fsdp_config__offload_params=True`), as an Axolotl `DictDefault`: a dict read
as attributes, a missing key read as None. It is validated where it is used, for what is used:
the merge reads a few keys, so a value only training knows (`optimizer: adamw_anyprecision`, a
chat template name) does not stop it. shardforge's own `shardforge.config.load_cfg` validates
every key at once instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardforge.config.dict_default import DictDefault


def load_cfg(config: str | Path | Mapping[str, Any], **kwargs: Any) -> DictDefault:
    """Read `config` (a YAML file, a directory holding one, or a mapping such as another
    `DictDefault`) and apply `kwargs` as overrides; nothing is validated yet.

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping of keys.
    """
    from shardforge.config.loader import read_cfg

    return read_cfg(config, **kwargs)


__all__ = ["DictDefault", "load_cfg"]
