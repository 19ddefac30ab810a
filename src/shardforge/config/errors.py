"""Turn pydantic's validation errors into one line per problem, in the user's key names."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from shardforge.errors import MAX_VALUE, shown

# characters of a key name echoed (a key is a value too: YAML allows any string)
MAX_KEY = 80

_EXPECTED = {
    "bool_parsing": "expected a boolean (true/false)",
    "bool_type": "expected a boolean (true/false)",
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def format_loc(loc: Sequence[int | str]) -> str:
    """('datasets', 0, 'path') -> 'datasets[0].path'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = str(part) if len(str(part)) <= MAX_KEY else shown(str(part), MAX_KEY)
            out += f".{name}" if out else name
    return out or "<config>"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `FsdpConfig`, `list[X]`, `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def fields_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The field names of the (sub)model that `loc` points into."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return []
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return []
        current = _model_in(field.annotation)
    return list(current.model_fields) if current is not None else []


def did_you_mean(name: str, candidates: Iterable[str], cutoff: float = 0.6) -> str:
    """ "; did you mean 'x'?" for the closest of `candidates`, or "" when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(err: Any, model: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    kind = err["type"]
    given = err.get("input")
    key = format_loc(loc)
    if kind == "extra_forbidden":
        hint = did_you_mean(str(loc[-1]), fields_at(model, loc[:-1]))
        if not hint:
            hint = "; see `shardforge config-schema` for the known keys"
        return f"{key}: unknown key{hint}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{key}: {shown(given)} is not supported; expected one of {expected}"
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        bound = next(iter(err.get("ctx", {}).items()), ("", ""))
        op = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}.get(bound[0], bound[0])
        return f"{key}: must be {op} {bound[1]}, got {shown(given)}"
    if kind in _EXPECTED:
        return f"{key}: {_EXPECTED[kind]}, got {shown(given)}"
    msg = str(err["msg"])
    msg = msg.removeprefix("Value error, ")
    if len(msg) > 2 * MAX_VALUE:  # a validator's message may quote the value
        msg = msg[: 2 * MAX_VALUE - 3] + "..."
    if not loc:
        return msg
    return f"{key}: {msg[:1].lower()}{msg[1:]}"


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> list[str]:
    """One message per problem, deduplicated, in the order pydantic found them."""
    seen: dict[str, None] = {}
    for err in exc.errors():
        seen.setdefault(_describe(err, model), None)
    return list(seen)
