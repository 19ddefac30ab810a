"""What a prepared data set depends on, its hash, and what changed between two of them.

    TOKEN_KEYS                  the config keys whose values change the prepared data
    key_inputs(cfg, tokenizer)  everything the prepared data depend on, as plain JSON data
    digest(inputs)              the hash that names a prepared data set's folder
    changes(old, new)           what differs between two `key_inputs`, in words

The inputs are: the format version and the versions of the code that tokenizes (shardforge,
transformers, tokenizers); the value of every key in `TOKEN_KEYS`; the sha256 of every file the
tokenizer is read from and of the chat template it ends up with; the sha256 of every data file
of `datasets` and `test_datasets`. Every data and tokenizer file is read in full: a changed file
is found by its contents, whatever its size or time stamp says.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import shown
from shardforge.io.model_files import TOKENIZER_FILES
from shardforge.train.readers import data_files

# the layout of a prepared folder (manifest and columns) and how it is split; a new one prepares
# everything anew. 2: val_set_size holds out Axolotl's samples (the last of the seed-shuffled
# merge), where 1 drew its own: a folder of 1 would train on another split
FORMAT_VERSION = 2

# Every config key whose value changes the prepared data (tokens, labels, packing, the split),
# mapped to the key that must be set for it to matter (None: it always matters). The only list:
# the hash, the reasons `train` gives and docs/preprocess.md derive from it, and a test fails if
# the data pipeline reads a config key that is neither here nor in TOKENIZER_SOURCE_KEYS.
TOKEN_KEYS: dict[str, str | None] = {
    "datasets": None,
    "test_datasets": None,
    "train_on_inputs": None,
    "sequence_len": None,
    "sample_packing": None,
    "eval_sequence_len": None,
    "eval_sample_packing": None,
    "val_set_size": None,
    "seed": None,  # the shuffles (which pick the held-out samples) and shards of the data
    "chat_template": None,
    "chat_template_jinja": None,
    "special_tokens": None,
    "tokens": None,
    "eot_tokens": None,
    "trust_remote_code": None,
    "tokenizer_use_fast": None,
    "tokenizer_legacy": None,
    "default_system_message": None,
    "chat_template_kwargs": None,
    "min_sample_len": None,
    "excess_length_strategy": None,
    "dataset_exact_deduplication": None,
    "shuffle_before_merging_datasets": None,
    "shuffle_merged_datasets": None,
    "dataset_shard_num": None,
    "dataset_shard_idx": "dataset_shard_num",
}
# Where the tokenizer is read from: not hashed as a name, its files are (a moved model folder
# prepares nothing anew; an edited tokenizer.json does).
TOKENIZER_SOURCE_KEYS: tuple[str, ...] = ("tokenizer_config", "base_model")

# a folder of named chat templates beside them
TEMPLATES_DIR = "additional_chat_templates"
# the data sets' config keys
DATA_LISTS: tuple[str, ...] = ("datasets", "test_datasets")
# the packages whose code turns rows into tokens
TOKENIZING_PACKAGES: tuple[str, ...] = ("transformers", "tokenizers")
# hex digits of the sha256 that name a prepared folder
HASH_CHARS = 16


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_inputs(cfg: ShardforgeConfig) -> dict[str, Any]:
    """The value of every key of TOKEN_KEYS that matters for this config."""
    plain = cfg.to_dict()
    return {
        key: plain[key] for key, needs in TOKEN_KEYS.items() if needs is None or plain.get(needs)
    }


def data_inputs(cfg: ShardforgeConfig) -> dict[str, dict[str, str]]:
    """sha256 of every data file, per data set entry (`datasets[0]`: {file name: sha256})."""
    out: dict[str, dict[str, str]] = {}
    for list_key in DATA_LISTS:
        for i, ds in enumerate(cfg[list_key]):
            key = f"{list_key}[{i}]"
            out[key] = {file.name: file_sha256(file) for file, _kind in data_files(ds, key)}
    return out


def tokenizer_folder(cfg: ShardforgeConfig) -> Path | None:
    """The folder the tokenizer was read from: the local one, or a hub id's cached snapshot
    (None: not in the cache, which a loaded tokenizer always is)."""
    source = cfg.tokenizer_config or cfg.base_model
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:  # not cached, or not a hub id: the tokenizer loaded from elsewhere
        return None


def tokenizer_inputs(cfg: ShardforgeConfig, tokenizer: Any) -> dict[str, Any]:
    """sha256 of the tokenizer's files and of the chat template it ends up with."""
    folder = tokenizer_folder(cfg)
    files: dict[str, str] = {}
    if folder is not None:
        vocab = getattr(tokenizer, "vocab_files_names", {}) or {}
        names = sorted({*TOKENIZER_FILES, *map(str, vocab.values())})
        paths = [folder / n for n in names] + sorted((folder / TEMPLATES_DIR).glob("*"))
        files = {p.relative_to(folder).as_posix(): file_sha256(p) for p in paths if p.is_file()}
    template = tokenizer.chat_template
    out: dict[str, Any] = {
        "files": files,
        "chat_template": None
        if template is None
        else _text_sha256(json.dumps(template, sort_keys=True)),
    }
    if folder is None:
        out["source"] = cfg.tokenizer_config or cfg.base_model
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import version

    from shardforge.version import __version__

    return {"shardforge": __version__, **{name: version(name) for name in TOKENIZING_PACKAGES}}


def key_inputs(cfg: ShardforgeConfig, tokenizer: Any) -> dict[str, Any]:
    """Everything the prepared data of `cfg` depend on (`tokenizer`: from `load_tokenizer`)."""
    return {
        "format": FORMAT_VERSION,
        "versions": versions(),
        "config": config_inputs(cfg),
        "tokenizer": tokenizer_inputs(cfg, tokenizer),
        "data": data_inputs(cfg),
    }


def digest(inputs: dict[str, Any]) -> str:
    """The hash of `key_inputs`: the name of its prepared folder."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()[:HASH_CHARS]


_MISSING = object()


def _differences(
    old: Any, new: Any, path: tuple[Any, ...]
) -> list[tuple[tuple[Any, ...], Any, Any]]:
    """(path, old, new) of every leaf that differs (_MISSING: absent on that side)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            diff
            for key in sorted({*old, *new}, key=str)
            for diff in _differences(old.get(key, _MISSING), new.get(key, _MISSING), (*path, key))
        ]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for d in _differences(a, b, (*path, i))
        ]
    return [] if old == new else [(path, old, new)]


def _dotted(parts: tuple[Any, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _value(value: Any) -> str:
    return "unset" if value is _MISSING else shown(value, 60)


def _version(value: Any) -> str:
    return "unset" if value is _MISSING else str(value)


def _file_change(what: str, old: Any, new: Any) -> str:
    if old is _MISSING:
        return f"{what} was added"
    if new is _MISSING:
        return f"{what} was removed"
    return f"{what} changed"


def _describe(path: tuple[Any, ...], old: Any, new: Any) -> str:
    head, rest = path[0], path[1:]
    if head == "config" and rest:
        return f"{_dotted(rest)}: {_value(old)} -> {_value(new)}"
    if head == "data" and len(rest) == 2:
        return _file_change(f"{rest[0]}: {rest[1]}", old, new)
    if head == "data" and len(rest) == 1:
        return _file_change(f"{rest[0]}'s files", old, new)
    if head == "tokenizer" and rest[:1] == ("files",) and len(rest) == 2:
        return _file_change(f"the tokenizer's {rest[1]}", old, new)
    if head == "tokenizer" and rest == ("chat_template",):
        return "the tokenizer's chat template changed"
    if head == "versions" and rest:
        return f"{rest[0]} {_version(old)} -> {_version(new)}"
    return f"{_dotted(path)} changed"


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two `key_inputs`, one phrase each ("sequence_len: 32 -> 64")."""
    return [_describe(path, a, b) for path, a, b in _differences(old, new, ())]
