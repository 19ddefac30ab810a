from __future__ import annotations

import json

from pydantic import BaseModel

from shardforge.cli.config_schema import do_config_schema
from shardforge.config.schema import ShardforgeConfig


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    from shardforge.config.errors import _model_in

    seen.add(model)
    for field in model.model_fields.values():
        sub = _model_in(field.annotation)
        if sub is not None and sub not in seen:
            _models(sub, seen)
    return seen


def test_every_field_has_a_description() -> None:
    models = _models(ShardforgeConfig, set())
    assert len(models) >= 4
    missing = [
        f"{m.__name__}.{name}"
        for m in models
        for name, field in m.model_fields.items()
        if not (field.description and len(field.description) > 10)
    ]
    assert missing == []


def test_transformer_layer_cls_accepts_string_or_list() -> None:
    a = ShardforgeConfig.model_validate(
        {"base_model": "m", "fsdp": {"transformer_layer_cls_to_wrap": "A, B"}}
    )
    b = ShardforgeConfig.model_validate(
        {"base_model": "m", "fsdp": {"transformer_layer_cls_to_wrap": ["A", "B"]}}
    )
    assert (
        a.fsdp.transformer_layer_cls_to_wrap == b.fsdp.transformer_layer_cls_to_wrap == ["A", "B"]
    )


def test_json_schema_lists_keys() -> None:
    schema = ShardforgeConfig.model_json_schema()
    assert schema["required"] == ["base_model"]
    assert "fsdp" in schema["properties"]
    assert schema["additionalProperties"] is False


def test_descriptions_are_one_line_in_the_json_schema() -> None:
    """The keys' docstrings are wrapped in the source; the schema (and so the docs and editors)
    get each key's description as one line, with single spaces."""
    schema = json.loads(do_config_schema())
    blocks = [schema, *schema["$defs"].values()]
    keys = [key for block in blocks for key in block.get("properties", {}).values()]
    assert len(keys) > 200
    wrapped = [
        k["description"] for k in keys if k["description"] != " ".join(k["description"].split())
    ]
    assert wrapped == []
