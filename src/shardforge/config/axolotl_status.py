"""What shardforge does with each key of Axolotl's config: decided here, by hand.

The keys themselves, with Axolotl's defaults, are `axolotl_keys.py`, generated from Axolotl's
released package (cicd/gen_axolotl_keys.py); the tests fail when a key there has no decision
here, or a decision names a key Axolotl no longer has. A key's status says what shardforge does
with it:

- implemented: same name, or `ours`; `refused` values are a feature `train` does not have;
- ignored: accepted with a notice: it cannot change the trained weights or the saved files;
- unsupported: `train` refuses a value other than a placeholder (null, an empty value or
  Axolotl's default; a flag whose Axolotl default is null means off, so false is one too).

`LEGACY_*` are keys Axolotl 0.21 does not define but its own example configs and docs still
carry (older spellings and options, FSDP1 settings). Axolotl's schema ignores a key it does not
define (pydantic's default, `extra="ignore"`: the key is dropped from the validated config), so
they have no effect there; shardforge names them in the ignored notice, or reads the older
spelling where it implements the feature. Any other key that is neither Axolotl's nor ours is
ignored the same way, unless it is a near miss of a known key (an error with a did-you-mean).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardforge.config.axolotl_keys import (
    DATASET_FIELDS,
    FSDP_CONFIG_FIELDS,
    TOP_LEVEL_FIELDS,
    AxolotlField,
)
from shardforge.config.axolotl_rows import (
    _DROPPED,
    _FSDP1,
    _FSDP2_MOOT_WRAP,
    _MEMORY,
    _ONLY_TYPES,
    _PREPROCESS,
    _SPEED,
    SCHEMA,
    AxolotlKey,
    Status,
    _g,
    _i,
    _u,
)
from shardforge.config.axolotl_top_level import A_TO_L
from shardforge.config.axolotl_top_level_m import M_TO_Z

__all__ = ["SCHEMA", "TOP_LEVEL_STATUS", "AxolotlKey", "Status"]

# Every top-level key of Axolotl's config (two modules: one would be over 600 lines).
TOP_LEVEL_STATUS: dict[str, AxolotlKey] = {**A_TO_L, **M_TO_Z}

# Keys of one `datasets:` entry.
DATASET_STATUS: dict[str, AxolotlKey] = {
    "chat_template": _i(),
    "chat_template_jinja": _i(),
    "conversation": _u("FastChat conversation templates"),
    "data_files": _i("files of the local folder `path`; Hub data sets are not downloaded"),
    "drop_system_message": _i(),
    "ds_type": _i(),
    "field": _i(),
    "field_chosen": _g(_ONLY_TYPES),
    "field_human": _u("legacy conversation field names"),
    "field_messages": _i(),
    "field_model": _u("legacy conversation field names"),
    "field_rejected": _g(_ONLY_TYPES),
    "field_thinking": _i(),
    "field_tools": _i(),
    "input_format": _u("custom prompt input formats"),
    "input_transform": _u("row transform functions"),
    "logprobs_field": _g(_ONLY_TYPES),
    "max_completion_length": _g(_ONLY_TYPES),
    "message_field_content": _i(
        "older spelling of message_property_mappings.content", ours="message_property_mappings"
    ),
    "message_field_role": _i(
        "older spelling of message_property_mappings.role", ours="message_property_mappings"
    ),
    "message_field_training": _i(),
    "message_field_training_detail": _i(),
    "message_property_mappings": _i(),
    "name": _i("a configuration of a local data set folder (README.md `configs:`)"),
    "path": _i(),
    "preprocess_shards": _g(_PREPROCESS),
    "revision": _i("a local path has no revisions (Axolotl ignores it there too)"),
    "roles": _i(),
    "roles_to_train": _i(),
    "shards": _i(),
    "shards_idx": _i(),
    "split": _i(),
    "split_thinking": _i(),
    "step_separator": _g(_ONLY_TYPES),
    "temperature": _g(_ONLY_TYPES),
    "template_thinking_key": _i(),
    "train_on_eos": _i(),
    "train_on_eot": _i(),
    "train_on_last_step_only": _g(_ONLY_TYPES),
    "trust_remote_code": _g("dataset loading scripts are never run; data are local files"),
    "type": _i("completion, chat_template, alpaca and input_output"),
    "weight": _i("rows taken round(weight x rows) times"),
}

# Keys of `fsdp_config`, without the `fsdp_` prefix.
FSDP_CONFIG_STATUS: dict[str, AxolotlKey] = {
    "activation_checkpointing": _i(),
    "auto_wrap_policy": _g(_FSDP2_MOOT_WRAP),
    "cpu_offload_pin_memory": _g(_SPEED),
    "cpu_ram_efficient_loading": _g(_MEMORY),
    "final_state_dict_type": _u("separate state dict type for the final save"),
    "fsdp_version": _i("2 only (FSDP2)"),
    "min_num_params": _g(_FSDP2_MOOT_WRAP),
    "mixed_precision_policy": _u("mixed-precision policy strings (use fsdp.mixed_precision)"),
    "offload_params": _i(),
    "reshard_after_forward": _i(),
    "state_dict_type": _i("SHARDED_STATE_DICT or FULL_STATE_DICT"),
    "transformer_layer_cls_to_wrap": _i(),
    "version": _i("2 only (FSDP2)", ours="fsdp_version"),
}

# Top-level keys of Axolotl's own example configs that Axolotl 0.21 does not define.
LEGACY_TOP_LEVEL: dict[str, AxolotlKey] = {
    "adam_eps": _g(f"{_DROPPED}: AdamW's epsilon is adam_epsilon"),
    "base_model_ignore_patterns": _g(f"{_DROPPED}; nothing is downloaded"),
    "debug": _g(f"{_DROPPED} (its --debug flag is not a config key); shardforge has --debug"),
    "eta_min": _g(f"{_DROPPED}: the schedule's floor is cosine_min_lr_ratio"),
    "fsdp": _i(
        "the list form (full_shard, shard_grad_op, offload, auto_wrap) is read as the fsdp "
        "block (Axolotl 0.21 refuses the list)"
    ),
    "full_finetune": _g(f"{_DROPPED}; a run without `adapter` is a full fine-tune"),
    "gptq_disable_exllama": _g(f"{_DROPPED} (older GPTQ settings)"),
    "gptq_groupsize": _g(f"{_DROPPED} (older GPTQ settings)"),
    "gptq_model_v1": _g(f"{_DROPPED} (older GPTQ settings)"),
    "sample_packing_seq_len_multiplier": _g(f"{_DROPPED} (an older packing option)"),
    "torch_dtype": _g(f"{_DROPPED}: the dtype follows bf16 / fp16"),
}

# FSDP1 keys of `fsdp_config` that Axolotl's older examples and docs show.
LEGACY_FSDP_CONFIG: dict[str, AxolotlKey] = {
    "backward_prefetch": _g(_FSDP1),
    "backward_prefetch_policy": _g(_FSDP1),
    "cpu_offload": _i("older spelling of offload_params", ours="offload_params"),
    "forward_prefetch": _g("FSDP1 only (Axolotl 0.21 refuses it); no meaning under FSDP2"),
    "limit_all_gathers": _g(_FSDP1),
    "sharding_strategy": _i(
        "FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2 are mapped to FSDP2 "
        "settings (Axolotl 0.21 refuses it: FSDP1 only)"
    ),
    "sync_module_states": _g(_FSDP1),
    "use_orig_params": _g(_FSDP1),
}

BOOLEAN_FLAGS: frozenset[str] = frozenset({"bool | None", "Optional[bool]"})


def placeholder(field: AxolotlField) -> Any:
    """The value of a key that changes nothing besides null: Axolotl's default; false for an
    on/off flag whose default is null (off)."""
    if field.default is None and field.annotation in BOOLEAN_FLAGS:
        return False
    return field.default


def _rows(
    fields: Mapping[str, AxolotlField],
    status: Mapping[str, AxolotlKey],
    legacy: Mapping[str, AxolotlKey],
) -> dict[str, AxolotlKey]:
    """The decisions with their placeholders filled in from Axolotl's defaults; the legacy keys
    after them (a legacy row's placeholder is null only)."""
    out = {}
    for key, row in status.items():
        if row.default is SCHEMA:
            field = fields.get(key, AxolotlField(None, ""))
            row = row._replace(default=placeholder(field))
        out[key] = row
    for key, row in legacy.items():
        out[key] = row._replace(default=None) if row.default is SCHEMA else row
    return out


TOP_LEVEL = _rows(TOP_LEVEL_FIELDS, TOP_LEVEL_STATUS, LEGACY_TOP_LEVEL)
DATASET_KEYS = _rows(DATASET_FIELDS, DATASET_STATUS, {})
FSDP_CONFIG_KEYS = _rows(FSDP_CONFIG_FIELDS, FSDP_CONFIG_STATUS, LEGACY_FSDP_CONFIG)
