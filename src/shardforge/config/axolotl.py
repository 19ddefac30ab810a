"""Sort the keys of a config into what a command uses, what it may ignore and what it refuses.

A config may hold shardforge's own keys and any key of Axolotl's schema (the keys in
``axolotl_keys``, what shardforge does with each in ``axolotl_status``). For one command:

    ours, in the command's scope        kept and validated
    ours, outside the scope             not used (merge and inspect read only a few keys)
    Axolotl, implemented elsewhere      renamed (flash_attention: true -> attn_implementation)
    Axolotl, null or its default        a placeholder: changes nothing, accepted everywhere
    Axolotl, ignored                    no effect on results: dropped, named in one notice
    Axolotl, unsupported                train: one problem line each; other commands: not used
    neither, a near miss of a known key a problem, with a suggestion among keys of the same level
    neither                             ignored, named in one notice (as Axolotl drops a key
                                        it does not define)

Pure functions over plain mappings; the loader turns the result into notices and errors.
"""

from __future__ import annotations

import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from shardforge.config.axolotl_status import (
    DATASET_KEYS,
    FSDP_CONFIG_KEYS,
    LEGACY_FSDP_CONFIG,
    LEGACY_TOP_LEVEL,
    TOP_LEVEL,
    AxolotlKey,
)
from shardforge.config.errors import did_you_mean
from shardforge.config.schema import DatasetConfig, FsdpConfig, ShardforgeConfig

Command = Literal["train", "merge", "merge-lora", "inspect", "all"]
COMMANDS: tuple[str, ...] = ("train", "merge", "merge-lora", "inspect", "all")

# What every merge reads (the chat template only where it writes a tokenizer). Not the fsdp
# block: how the shards were cut is in the checkpoint's own metadata.
_MERGE_KEYS = frozenset(
    {
        "base_model",
        "base_model_config",
        "tokenizer_config",
        "output_dir",
        "storage_options",
        "trust_remote_code",
        "chat_template",
        "chat_template_jinja",
    }
)
# A LoRA run's checkpoint without its own adapter_config.json: the merge writes one from these,
# so it reads them only when the config says the run trained a LoRA adapter (`adapter: lora`)
LORA_RUN_KEYS = frozenset(
    {
        "adapter",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_linear",
        "lora_target_parameters",
        "lora_modules_to_save",
        "peft_use_rslora",
        "peft_use_dora",
        "lora_fan_in_fan_out",
        "lora_rank_pattern",
        "lora_alpha_pattern",
        "peft_layers_to_transform",
        "peft_layers_pattern",
        # a QLoRA / 8-bit run's adapter is a LoRA adapter; the keys keep its config valid
        "load_in_4bit",
        "load_in_8bit",
        "bnb_config_kwargs",
    }
)

# The keys each command reads (None: every key).
COMMAND_KEYS: dict[str, frozenset[str] | None] = {
    "train": None,
    "all": None,
    "merge": _MERGE_KEYS | LORA_RUN_KEYS,
    # merge-lora reads the adapter's settings from its adapter_config.json
    "merge-lora": _MERGE_KEYS | {"lora_model_dir"},
    "inspect": frozenset({"base_model", "output_dir", "storage_options"}),
}
# Commands that read only their own keys: everything else in the config is left unread.
SCOPED: frozenset[str] = frozenset(c for c, keys in COMMAND_KEYS.items() if keys is not None)

# Axolotl boolean flags implemented as a value of one of our keys.
FLAG_VALUES: dict[str, tuple[str, Any]] = {
    "flash_attention": ("attn_implementation", "flash_attention_2"),
    "sdp_attention": ("attn_implementation", "sdpa"),
    "eager_attention": ("attn_implementation", "eager"),
    "flex_attention": ("attn_implementation", "flex_attention"),
}

# Understood without a key of ours (the classes come from config.json, AutoTokenizer).
IMPLICIT: frozenset[str] = frozenset({"tokenizer_type", "model_type"})
# Older dataset-entry spellings that DatasetConfig itself folds into message_property_mappings.
DATASET_LEGACY: tuple[str, ...] = ("message_field_role", "message_field_content")
# Top-level keys whose entries are `datasets:` entries (DatasetConfig, Axolotl's DATASET_KEYS).
DATASET_LISTS: tuple[str, ...] = ("datasets", "test_datasets")


@dataclass
class Sorted:
    """What a command makes of a config's keys (dotted paths for nested ones)."""

    data: dict[str, Any]
    unused: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    placeholders: list[str] = field(default_factory=list)
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (key, feature)
    renamed: list[str] = field(default_factory=list)
    # neither shardforge's nor Axolotl's (and no near miss of a known key): ignored
    undefined: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def is_placeholder(value: Any, row: AxolotlKey) -> bool:
    """null, an empty value, or Axolotl's own default: the key changes nothing."""
    if value is None or value == row.default:
        return True
    return isinstance(value, str | list | dict) and not value


def suggest(name: str, candidates: Collection[str]) -> str:
    """A did-you-mean among keys of the same level, only for a close spelling."""
    return did_you_mean(name, candidates, cutoff=0.75)


def _nullable(model: type[BaseModel]) -> set[str]:
    """Fields of `model` for which null is a value of its own (not just "unset")."""
    out = set()
    for name, info in model.model_fields.items():
        args = typing.get_args(info.annotation)
        if info.annotation is None or type(None) in args:
            out.add(name)
    return out


def _sort_level(
    data: Mapping[str, Any],
    model: type[BaseModel],
    theirs: Mapping[str, AxolotlKey],
    where: str,
    out: Sorted,
    refuse_unsupported: bool,
    also_ours: Collection[str] = (),
) -> dict[str, Any]:
    """Keys of one mapping: ours kept; Axolotl's placed, dropped or refused; others problems.

    A bare `key:` (null) of ours that has no null value of its own means "unset", as in
    Axolotl's own examples (`fp16:`, `fsdp:`): the default applies.
    """
    ours = {*model.model_fields, *also_ours}
    nullable = _nullable(model)
    kept: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key)
        dotted = f"{where}{name}"
        if name in ours:
            row = theirs.get(name)
            if refuse_unsupported and row is not None and _refused(value, row.refused):
                out.unsupported.append((dotted, row.note))
            if value is None and name in model.model_fields and name not in nullable:
                out.placeholders.append(dotted)
            else:
                kept[name] = value
            continue
        row = theirs.get(name)
        if row is None:
            hint = suggest(name, [*ours, *theirs])
            if hint:
                out.problems.append(f"{dotted}: unknown key{hint}")
            else:
                out.undefined.append(dotted)
        elif name in FLAG_VALUES and row.status == "implemented":
            target, flag_value = FLAG_VALUES[name]
            if value:
                kept.setdefault(target, flag_value)
                out.renamed.append(f"{dotted} -> {target}: {flag_value}")
        elif row.status == "implemented" and row.ours and row.ours in ours:
            kept.setdefault(row.ours, value)
            out.renamed.append(f"{dotted} -> {row.ours}")
        elif row.status == "implemented":
            out.ignored.append(dotted)
        elif is_placeholder(value, row):
            out.placeholders.append(dotted)
        elif row.status == "ignored":
            out.ignored.append(dotted)
        elif refuse_unsupported:
            out.unsupported.append((dotted, row.note or "not supported"))
        else:
            out.unused.append(dotted)
    return kept


def _refused(value: Any, refused: tuple[Any, ...]) -> bool:
    """`value` is one a partly implemented key refuses (compared by type too: 1 is not True)."""
    return any(type(value) is type(r) and value == r for r in refused)


def command_scope(command: str, data: Mapping[str, Any]) -> frozenset[str] | None:
    """The keys `command` reads of this config (None: every key)."""
    scope = COMMAND_KEYS[command]
    if command == "merge" and scope is not None and data.get("adapter") not in ("lora", "qlora"):
        return scope - LORA_RUN_KEYS
    return scope


def sort_keys(data: Mapping[str, Any], command: str) -> Sorted:
    """Sort a normalized config (fsdp already in shardforge's block form) for `command`."""
    if command not in COMMAND_KEYS:
        raise ValueError(f"unknown command {command!r}; expected one of {', '.join(COMMANDS)}")
    out = Sorted(data={})
    scope = command_scope(command, data)
    if scope is not None:
        out.unused = [str(k) for k in data if k not in scope]
        nullable = _nullable(ShardforgeConfig)
        # a bare `key:` of a key with no null value of its own means "unset", as for train
        out.data = {
            str(k): v
            for k, v in data.items()
            if k in scope
            and (v is not None or k in nullable or k not in ShardforgeConfig.model_fields)
        }
        known = known_top_level_keys()
        for key in out.unused:  # a misspelt key the command needs must not pass unnoticed
            hint = suggest(key, scope) if key not in known else ""
            if hint:
                out.problems.append(f"{key}: unknown key{hint}")
        return out
    refuse = command == "train"
    kept = _sort_level(data, ShardforgeConfig, TOP_LEVEL, "", out, refuse)
    if isinstance(kept.get("fsdp"), Mapping):
        kept["fsdp"] = _sort_level(kept["fsdp"], FsdpConfig, FSDP_CONFIG_KEYS, "fsdp.", out, refuse)
    for list_key in DATASET_LISTS:
        if isinstance(kept.get(list_key), list):
            kept[list_key] = [
                _sort_level(
                    entry,
                    DatasetConfig,
                    DATASET_KEYS,
                    f"{list_key}[{i}].",
                    out,
                    refuse,
                    DATASET_LEGACY,
                )
                if isinstance(entry, Mapping)
                else entry
                for i, entry in enumerate(kept[list_key])
            ]
    out.data = kept
    return out


def known_top_level_keys() -> set[str]:
    """Every key a config may hold at the top: shardforge's and Axolotl's."""
    return set(ShardforgeConfig.model_fields) | set(TOP_LEVEL)


def unsupported_problem(key: str, feature: str) -> str:
    return f"{key}: {feature} is not supported by shardforge train yet; remove the key"


def compatibility_table() -> str:
    """docs/config.md's Axolotl table (markdown), generated from the same tables the code uses."""
    from shardforge.config.axolotl_keys import AXOLOTL_VERSION, AXOLOTL_WHEEL_SHA256

    lines = [
        f"Generated from Axolotl {AXOLOTL_VERSION} (the released wheel, sha256 "
        f"{AXOLOTL_WHEEL_SHA256[:12]}...) by `shardforge config-schema --axolotl-table`.",
        "",
    ]
    legacy = {**LEGACY_TOP_LEVEL, **{f"fsdp_config.{k}": r for k, r in LEGACY_FSDP_CONFIG.items()}}
    for title, table, prefix in (
        ("Top-level keys", _without(TOP_LEVEL, LEGACY_TOP_LEVEL), ""),
        ("Keys of a `datasets:` entry", DATASET_KEYS, "datasets[]."),
        (
            "Keys of `fsdp_config:` (with or without the `fsdp_` prefix)",
            _without(FSDP_CONFIG_KEYS, LEGACY_FSDP_CONFIG),
            "",
        ),
        (f"Keys Axolotl {AXOLOTL_VERSION} does not define (older examples and docs)", legacy, ""),
    ):
        lines += _section(title, table, prefix)
    return "\n".join(lines).rstrip() + "\n"


def _without(table: Mapping[str, AxolotlKey], drop: Mapping[str, Any]) -> dict[str, AxolotlKey]:
    return {k: r for k, r in table.items() if k not in drop}


def _section(title: str, table: Mapping[str, AxolotlKey], prefix: str) -> list[str]:
    counts = {s: sum(r.status == s for r in table.values()) for s in STATUS_ORDER}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [f"#### {title} ({summary})", "", "| key | status | note |", "| --- | --- | --- |"]
    for key in sorted(table):
        row = table[key]
        note = row.note
        if row.ours and row.ours != key:
            note = f"as `{row.ours}`" + (f"; {note}" if note else "")
        note = note.replace("|", "\\|")
        lines.append(f"| `{prefix}{key}` | {row.status} | {note} |")
    return [*lines, ""]


STATUS_ORDER: tuple[str, ...] = ("implemented", "ignored", "unsupported")
