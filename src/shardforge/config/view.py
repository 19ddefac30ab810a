"""The read-only view every config block shares: ``cfg.key``, ``cfg["key"]``, ``cfg.get("key")``.

`load_cfg` returns the validated `ShardforgeConfig` itself: its fields are typed for mypy, and
code written for Axolotl's ``DictDefault`` keeps working (attribute and item reads, ``get``,
``to_dict``). The config is validated once, by `load_cfg`, and never again; so it cannot be
changed afterwards: a write raises `ConfigReadOnlyError`, which says how to pass the change to
`load_cfg` (or on the command line) instead, where it is validated with the rest.
"""

from __future__ import annotations

from collections.abc import ItemsView, KeysView
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from shardforge.config.errors import did_you_mean
from shardforge.errors import ShardforgeError, shorten, shown

# the most characters of the one line a write gets
MAX_LINE = 300


class ConfigReadOnlyError(ShardforgeError, AttributeError):
    """A write to a loaded config. Overrides are passed to `load_cfg`, which validates them."""


class ConfigView(BaseModel):
    """A block of the config: strict (an unknown key is an error), frozen, readable as a mapping.

    A key's description is the docstring under it (pydantic's `use_attribute_docstrings`),
    wrapped as the source needs; the JSON schema and the docs get it as one line.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    # where this block sits in a config ("fsdp."), for the advice a write gets; None: an entry
    # of a list (`datasets:`), which an override replaces whole
    override_prefix: ClassVar[str | None] = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Each description as one line (pydantic keeps a docstring's line breaks)."""
        super().__pydantic_init_subclass__(**kwargs)
        for field in cls.__pydantic_fields__.values():
            field.description = _one_line(field.description)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The JSON schema with each key's description as one line too (the schema was built
        from the docstrings as they are, before `__pydantic_init_subclass__`)."""
        schema = handler(core_schema)
        for key in handler.resolve_ref_schema(schema).get("properties", {}).values():
            if "description" in key:
                key["description"] = _one_line(key["description"])
        return schema

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key`, or `default` when the block has no such key (as ``dict.get``)."""
        return getattr(self, key) if key in type(self).model_fields else default

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(self._no_key(key))
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields

    def keys(self) -> KeysView[str]:
        return type(self).model_fields.keys()

    def items(self) -> ItemsView[str, Any]:
        return {name: getattr(self, name) for name in type(self).model_fields}.items()

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts and lists all the way down (what `shardforge validate` prints)."""
        return self.model_dump(mode="python")

    def to_model(self) -> Self:
        """The config itself (already validated): kept for code written for the addict view."""
        return self

    def _no_key(self, name: str) -> str:
        return f"config has no key {name!r}{did_you_mean(name, list(type(self).model_fields))}"

    if not TYPE_CHECKING:  # mypy keeps checking attribute names against the fields

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):  # pydantic's own machinery
                return super().__getattr__(name)
            raise AttributeError(self._no_key(name))

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigReadOnlyError(_read_only(type(self).override_prefix, name, value))

    def __delattr__(self, name: str) -> None:
        raise ConfigReadOnlyError(_read_only(type(self).override_prefix, name, _DELETED))


def _one_line(text: str | None) -> str | None:
    return None if text is None else " ".join(text.split())


_DELETED = object()  # `del cfg.key`: no value to show


def _read_only(prefix: str | None, name: str, value: Any) -> str:
    """The one line a write to the loaded config gets: where the change goes instead."""
    return shorten(_advice(prefix, name, value), MAX_LINE)


def _advice(prefix: str | None, name: str, value: Any) -> str:
    if prefix is None:
        return (
            f"the config is read-only (load_cfg validated it once): cannot set {name} of a "
            "list entry; pass the whole list to load_cfg instead: load_cfg(path, datasets=[...])"
        )
    key = prefix + name
    shown_value = "..." if value is _DELETED else shown(value, 60)
    call = f"{key}={shown_value}" if not prefix else f"**{{{key!r}: {shown_value}}}"
    return (
        f"the config is read-only (load_cfg validated it once): cannot set {key}; pass the "
        f"change to load_cfg instead: load_cfg(path, {call}), or on the command line "
        f"--{key} VALUE"
    )
