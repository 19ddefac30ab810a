"""Axolotl's `DictDefault`: a config as written, read as attributes, a missing key read as None.

`shardforge.cli.config.load_cfg` returns one, as Axolotl's `load_cfg` does: the YAML with the
caller's overrides, not yet validated. Each shardforge function given it validates the keys it
reads, once (`coerce_cfg`): the merge its few keys, so a value only training uses (an optimizer
shardforge does not have, a template name) never stops a merge; `train` every key.

    cfg = load_cfg("cfg.yml", learning_rate=1e-4)
    cfg.output_dir, cfg["base_model"], cfg.datasets[0].path, cfg.no_such_key  # -> None
    cfg.lora_model_dir = "runs/adapter"     # a dict: writes are allowed, validated on use
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from addict import Dict

from shardforge.errors import ConfigError


class DictDefault(Dict):
    """Axolotl's `DictDefault`: addict's `Dict` with a missing key read as None (no
    auto-created child), nested mappings (also in lists, and when assigned) DictDefaults too.
    `source` names where it was read from, for the errors of the command that validates it."""

    def __init__(self, data: Mapping[str, Any] | None = None, source: str = "<config>") -> None:
        super().__init__({str(k): v for k, v in (data or {}).items()})
        object.__setattr__(self, "_source", source)

    @property
    def source(self) -> str:
        try:
            return str(object.__getattribute__(self, "_source"))
        except AttributeError:  # made by addict's own copies (deepcopy, a nested hook)
            return "<config>"

    def __missing__(self, key: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # a protocol probe (copy, pickle, pydantic), not a key
            raise AttributeError(name)
        return self[name]

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, self._hook(value))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled and copied with its source
        return (type(self), (self.to_dict(), self.source))

    def __deepcopy__(self, memo: dict[int, Any]) -> DictDefault:
        return type(self)(copy.deepcopy(self.to_dict(), memo), self.source)


def config_file(config: str | Path) -> Path:
    """`config`, or the one YAML file in the directory `config` (as Axolotl picks it)."""
    path = Path(config)
    if not path.is_dir():
        return path
    found = sorted(p for p in path.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())
    if len(found) == 1:
        return found[0]
    names = ", ".join(p.name for p in found[:8]) or "none"
    raise ConfigError(str(path), [f"a directory: name one of its config files ({names})"])
