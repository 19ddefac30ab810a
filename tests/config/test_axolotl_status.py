"""The decisions of axolotl_status.py against the generated axolotl_keys.py: every key of
Axolotl's schema decided once, placeholders from Axolotl's defaults, implemented rows naming a
key of ours."""

from __future__ import annotations

import pytest

from shardforge.config.axolotl_keys import CHAT_TEMPLATE_NAMES as AXOLOTL_TEMPLATES
from shardforge.config.axolotl_keys import (
    DATASET_FIELDS,
    FSDP_CONFIG_FIELDS,
    TOP_LEVEL_FIELDS,
    AxolotlField,
)
from shardforge.config.axolotl_status import (
    DATASET_KEYS,
    DATASET_STATUS,
    FSDP_CONFIG_KEYS,
    FSDP_CONFIG_STATUS,
    LEGACY_FSDP_CONFIG,
    LEGACY_TOP_LEVEL,
    TOP_LEVEL,
    TOP_LEVEL_STATUS,
)
from shardforge.config.schema import DatasetConfig, FsdpConfig, ShardforgeConfig


def test_every_implemented_key_exists_on_our_side() -> None:
    """An `implemented` row names a key of ours (same name or `ours`), or is understood
    without one (flags, model/tokenizer class names, the Axolotl fsdp spellings)."""
    from shardforge.config.axolotl import FLAG_VALUES, IMPLICIT

    top = set(ShardforgeConfig.model_fields)
    for table, ours in (
        (TOP_LEVEL, top),
        (DATASET_KEYS, set(DatasetConfig.model_fields)),
        (FSDP_CONFIG_KEYS, set(FsdpConfig.model_fields)),
    ):
        for key, row in table.items():
            if row.status != "implemented" or key in FLAG_VALUES or key in IMPLICIT:
                continue
            target = (row.ours or key).split(".")[-1]
            assert (
                key in ours
                or target in ours
                or target in top
                or key
                in (
                    "fsdp_config",
                    "fsdp_version",
                    "version",
                    "sharding_strategy",
                    "cpu_offload",
                    "message_field_role",
                    "message_field_content",
                )
            ), (key, row)


@pytest.mark.parametrize(
    ("fields", "status", "legacy"),
    [
        (TOP_LEVEL_FIELDS, TOP_LEVEL_STATUS, LEGACY_TOP_LEVEL),
        (DATASET_FIELDS, DATASET_STATUS, {}),
        (FSDP_CONFIG_FIELDS, FSDP_CONFIG_STATUS, LEGACY_FSDP_CONFIG),
    ],
    ids=["top-level", "datasets", "fsdp_config"],
)
def test_every_key_of_the_generated_table_has_one_decision(
    fields: dict[str, object], status: dict[str, object], legacy: dict[str, object]
) -> None:
    """A regenerated axolotl_keys.py with a new key fails here until the key is decided; a
    decision for a key Axolotl no longer defines moves to the legacy rows (or goes)."""
    assert set(status) == set(fields), set(fields) ^ set(status)
    assert not set(legacy) & set(fields)


def test_placeholders_come_from_axolotls_defaults() -> None:
    """Axolotl's default is a placeholder; a flag whose default is null (off) has false too;
    a decision may name another (a plugin's flag is off unless the plugin is listed)."""
    assert TOP_LEVEL_FIELDS["weight_decay"].default == 0.0 == TOP_LEVEL["weight_decay"].default
    assert TOP_LEVEL_FIELDS["gptq"] == AxolotlField(None, "bool | None")
    assert TOP_LEVEL["gptq"].default is False
    assert TOP_LEVEL_FIELDS["cut_cross_entropy"].default is True
    assert TOP_LEVEL["cut_cross_entropy"].default is False
    assert all(TOP_LEVEL[k].default is None for k in LEGACY_TOP_LEVEL)


def test_the_chat_template_names_are_axolotls_enum() -> None:
    assert len(AXOLOTL_TEMPLATES) == 37
    assert {"tokenizer_default", "jinja", "gemma3", "qwen3_5", "chatml"} <= set(AXOLOTL_TEMPLATES)


def test_our_keys_that_axolotl_has_are_marked_implemented() -> None:
    for key in set(ShardforgeConfig.model_fields) & set(TOP_LEVEL):
        assert TOP_LEVEL[key].status == "implemented", key


def test_the_table_is_large_and_classified() -> None:
    assert len(TOP_LEVEL) > 200  # Axolotl's schema, not a hand-picked sample
    statuses = {row.status for row in TOP_LEVEL.values()}
    assert statuses == {"implemented", "ignored", "unsupported"}
    for key in ("gptq", "rl", "deepspeed", "lisa_n_layers"):
        assert TOP_LEVEL[key].status == "unsupported", key
    for key in ("use_comet", "dataset_num_proc", "strict"):
        assert TOP_LEVEL[key].status == "ignored", key
