"""The decisions of axolotl_status.py against the generated axolotl_keys.py: every key of
Axolotl's schema decided once, placeholders from Axolotl's defaults, implemented rows naming a
key of ours."""

from __future__ import annotations

import re
from typing import Any

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


# the plugin each `_only` row that names a plugin means (Axolotl's class path)
_PLUGINS = {
    "the knowledge-distillation plugin": "axolotl.integrations.kd.KDPlugin",
    "the Grokfast plugin": "axolotl.integrations.grokfast.GrokfastPlugin",
    "the Spectrum plugin": "axolotl.integrations.spectrum.SpectrumPlugin",
}
_SIDE = re.compile(r"read only with (?P<trigger>.+) \((?P<feature>[^()]+)\), which train refuses$")


def _triggers() -> dict[str, list[str]]:
    """trigger (as a row names it) -> the side keys of the rows that name it"""
    out: dict[str, list[str]] = {}
    for key, row in TOP_LEVEL.items():
        m = _SIDE.match(row.note)
        if m:
            out.setdefault(m.group("trigger"), []).append(key)
    return out


@pytest.mark.parametrize("trigger", sorted(_triggers()))
def test_a_side_key_is_ignored_only_while_train_refuses_its_trigger(trigger: str) -> None:
    """Each key ignored as "read only with TRIGGER" (`_only`): train refuses TRIGGER itself
    (a value of another key, a plugin, or a key of its own row), so the side key alone changes
    nothing; once TRIGGER is implemented, its side keys must be decided again."""
    from shardforge.config import validate_cfg
    from shardforge.errors import ConfigError

    assert all(TOP_LEVEL[k].status == "ignored" for k in _triggers()[trigger])
    value = re.fullmatch(r"(\w+): (\S+)", trigger)
    larger = re.fullmatch(r"(\w+) > 1", trigger)
    if trigger in _PLUGINS:
        turned_on: dict[str, Any] = {"plugins": [_PLUGINS[trigger]]}
    elif value or larger:
        key = (value or larger).group(1)  # type: ignore[union-attr]
        turned_on = {key: value.group(2) if value else 2}
    else:  # one key or several ("a / b"), each refused by its own row
        for key in trigger.split(" / "):
            assert TOP_LEVEL[key].status == "unsupported", (trigger, key)
        return
    raw = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    with pytest.raises(ConfigError) as info:
        validate_cfg({**raw, **turned_on}, command="train")
    assert next(iter(turned_on)) in str(info.value), str(info.value)


def test_the_side_keys_of_refused_features_are_ignored() -> None:
    """The side keys of Dion, Q-GaLore, CAME, MixLoRA, expert parallelism, the MoE kernels and
    the Grokfast / Spectrum plugins (issue 34): no longer counted as refused features."""
    triggers = _triggers()
    for trigger, some in {
        "optimizer: dion": "dion_lr",
        "optimizer: q_galore_adamw8bit": "qgalore_rank",
        "optimizer: came_pytorch": "adam_beta3",
        "adapter: mixlora": "mixlora_num_experts",
        "expert_parallel_size > 1": "expert_parallel_backend",
        "use_scattermoe": "moe_grouped_backend",
        "use_dsv4_kernels": "dsv4_bf16_all",
        "use_sonicmoe": "nvfp4_merge_aware",
        "model_quantization_config": "model_quantization_config_kwargs",
        "the Grokfast plugin": "grokfast_alpha",
        "the Spectrum plugin": "spectrum_top_fraction",
    }.items():
        assert some in triggers[trigger], trigger
    assert sum(row.status == "unsupported" for row in TOP_LEVEL.values()) <= 140
