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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardforge.errors import ConfigError


def _wrap(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, DictDefault):
        return DictDefault(value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class DictDefault(dict[str, Any]):
    """A dict whose keys read as attributes; a missing one reads as None (Axolotl's semantics).
    Nested mappings (and mappings in lists) are DictDefaults too. `source` names where it was
    read from, for the errors of the command that validates it."""

    def __init__(self, data: Mapping[str, Any] | None = None, source: str = "<config>") -> None:
        super().__init__({str(k): _wrap(v) for k, v in (data or {}).items()})
        object.__setattr__(self, "_source", source)

    @property
    def source(self) -> str:
        return str(object.__getattribute__(self, "_source"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        self.pop(name, None)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, _wrap(value))

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists all the way down."""
        return {k: _plain(v) for k, v in self.items()}


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
