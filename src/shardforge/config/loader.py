"""Read a YAML config, apply overrides, normalize Axolotl spellings and validate it once.

`load_cfg` returns the validated `ShardforgeConfig` (typed, read-only, readable as Axolotl's
``DictDefault``); `coerce_cfg` hands a config that is already validated on as it is, so one
command validates its config once."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from shardforge.config.axolotl import (
    COMMANDS,
    SCOPED,
    Sorted,
    sort_keys,
    unsupported_problem,
)
from shardforge.config.axolotl_keys import AXOLOTL_VERSION
from shardforge.config.chat_templates import template_problem
from shardforge.config.dict_default import DictDefault, config_file
from shardforge.config.errors import describe_validation_error
from shardforge.config.normalize import Notice, how_read, normalize_axolotl
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")


# values of a config: as written (keys, items and scalars: counted on the parser's events, before
# a node is built), and once its aliases are expanded (an alias bomb, `b: [*a, *a, ...]` nested,
# is refused before anything walks it). Configs hold hundreds
MAX_YAML_NODES = 200_000
# nesting of lists and mappings
MAX_YAML_DEPTH = 200
# bytes of a config file, checked before it is read: a config is kilobytes (the largest of
# Axolotl's examples, inline chat templates and all, is under 20 KB)
MAX_CONFIG_BYTES = 4 << 20
# the YAML 1.1 safe loader, libyaml's where PyYAML has it: a config up to its cap is parsed in
# about a second (the pure-Python one takes a minute over a 4 MB list of numbers)
_SAFE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(text: str) -> Any:
    """The YAML document `text`, refused (a YAMLError saying why) when it holds more than
    `MAX_YAML_NODES` values or nests deeper than `MAX_YAML_DEPTH` (counted on the parser's
    events: time and memory stay bounded), or expands to more values through its aliases,
    or an alias contains itself (on the composed nodes, before anything is constructed)."""
    _count_values(text)
    loader = _SAFE_LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _count_values(text: str) -> None:
    values = depth = 0
    for event in yaml.parse(text, Loader=_SAFE_LOADER):
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)):
            values += 1
            if values > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"the document holds more than {MAX_YAML_NODES:,} values (keys, list items "
                    "and scalars); a config holds hundreds: is it the right file?"
                )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise yaml.YAMLError(
                    f"lists and mappings nested deeper than {MAX_YAML_DEPTH} levels"
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_size(root: yaml.Node) -> None:
    """Count the nodes `root` stands for with every alias expanded (each distinct node is
    visited once, so this is quick even for an alias bomb)."""
    size: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    active: set[int] = set()
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            total = 1 + sum(size[id(c)] for c in _children(node))
            if total > MAX_YAML_NODES:
                raise yaml.YAMLError(
                    f"the document expands to more than {MAX_YAML_NODES:,} values through its "
                    "aliases (&anchor / *alias); refused"
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in active:
            raise yaml.YAMLError("an alias refers to a value that contains it; refused")
        if depth > MAX_YAML_DEPTH:
            raise yaml.YAMLError(f"lists and mappings nested deeper than {MAX_YAML_DEPTH} levels")
        active.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in _children(node) if id(c) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML mapping; syntax errors name the file, line and column; a file larger than
    `MAX_CONFIG_BYTES` (before a byte is read) and a document that holds, or expands to
    through its aliases (an alias bomb), more than `MAX_YAML_NODES` values are refused."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), ["config file not found; check the path"])
    try:
        data = _load(_config_text(p))  # a safe loader
    except RecursionError:
        raise ConfigError(str(p), ["invalid YAML: nested too deeply"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(where, [f"invalid YAML: {problem}"]) from None
    except UnicodeDecodeError:
        raise ConfigError(str(p), ["not a UTF-8 text file"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            str(p), [f"expected a mapping of keys at the top, got {type(data).__name__}"]
        )
    return data


def _config_text(p: Path) -> str:
    """The text of the config file `p`, refused when it is larger than a config can be."""
    with p.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(MAX_CONFIG_BYTES + 1) if size <= MAX_CONFIG_BYTES else b""
    if size > MAX_CONFIG_BYTES or len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            str(p),
            [
                f"{max(size, len(data)):,} bytes; a config file is at most "
                f"{MAX_CONFIG_BYTES >> 20} MiB (configs are kilobytes); give the YAML config, "
                "not a data file"
            ],
        )
    return data.decode("utf-8")


def _parse_value(text: str) -> Any:
    """A YAML scalar, with numbers such as `2e-5` (a string to YAML 1.1) read as numbers."""
    try:
        value = _load(text) if text != "" else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        for number in (int, float):
            try:
                return number(value)
            except ValueError:
                pass
    return value


def parse_override_args(args: Sequence[str], source: str = "command line") -> dict[str, Any]:
    """``['--learning_rate', '2e-5', '--fsdp.offload_params=true', '--bf16']`` -> dotted dict.

    Values are parsed as YAML scalars (``true``, ``2e-5``, ``[a, b]``); a flag without a value
    means ``true``. Nested keys use dots: ``--fsdp.reshard_after_forward false``.
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            problems.append(f"{arg!r}: expected an override like --key value or --key=value")
            i += 1
            continue
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 2
        else:
            key, text = body, "true"
            i += 1
        out[key.replace("-", "_")] = _parse_value(text)
    if problems:
        raise ConfigError(source, problems)
    return out


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _notices(found: Sorted, command: str, total: int) -> list[str]:
    """The notice lines of one sorted config: each kind of key once, in one line."""
    if command in SCOPED:
        unused = total - len(found.data)
        if not unused:
            return []
        others = "1 other key is" if unused == 1 else f"{unused} other keys are"
        return [
            how_read(
                f"{command} uses {len(found.data)} of the config's {total} top-level keys "
                f"({', '.join(found.data)}); {others} not used by this command"
            )
        ]
    out: list[str] = []
    if found.renamed:
        out.append(how_read(f"Axolotl keys read as shardforge's: {_listing(found.renamed)}"))
    if found.ignored:
        out.append(
            f"{len(found.ignored)} key(s) cannot change the result here and are ignored: "
            f"{_listing(found.ignored)} (see docs/config.md)"
        )
    if found.undefined:
        out.append(
            f"{len(found.undefined)} key(s) are neither shardforge's nor Axolotl "
            f"{AXOLOTL_VERSION}'s and are ignored, as Axolotl ignores keys it does not define: "
            f"{_listing(found.undefined)}"
        )
    if command == "all" and found.unsupported:
        keys = [k for k, _ in found.unsupported]
        out.append(
            f"{len(keys)} key(s) need features shardforge train does not support (train refuses "
            f"them; merge and inspect do not use them): {_listing(keys)}"
        )
    return out


def _template_problem(data: Mapping[str, Any]) -> str | None:
    """What is wrong with the config's chat template name, if anything (train refuses it; the
    other commands use it only where they write a tokenizer)."""
    value, text = data.get("chat_template"), data.get("chat_template_jinja")
    if not isinstance(value, str | None) or not isinstance(text, str | None):
        return None  # a wrong type: the schema says so
    return template_problem(value, text)


def _prepare(
    data: Mapping[str, Any], source: str, command: str, overrides: Mapping[str, Any]
) -> ShardforgeConfig:
    """Normalize Axolotl spellings, apply overrides, sort the keys for `command`, validate once.

    Every problem (unknown key, unsupported feature, wrong type, missing key) is raised at once.
    Commands that read only a few keys (merge, inspect) take them as they are and leave the rest,
    fsdp spellings included, unread.
    """
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
    flat = _flatten(overrides)
    total = len(set(map(str, data)) | {k.split(".", 1)[0] for k in flat})
    notices: list[Notice] = []
    problems: list[str] = []
    if command in SCOPED:
        normalized = dict(data)
    else:
        normalized, notices, problems = normalize_axolotl(dict(data))
    for dotted, value in flat.items():
        _set_dotted(normalized, dotted, value)
    found = sort_keys(normalized, command)
    problems = problems + found.problems
    template = _template_problem(found.data)
    if template and command == "train":
        problems.append(template)
    elif template and command == "all":
        notices.append(
            Notice(f"{template} (train refuses it; the merge keeps the tokenizer's own)")
        )
    problems += [unsupported_problem(key, feature) for key, feature in found.unsupported]
    for notice in [*notices, *_notices(found, command, total)]:
        level = logging.DEBUG if getattr(notice, "how_read", False) else logging.WARNING
        log.log(level, "%s: notice: %s", source, notice)
    try:
        model = ShardforgeConfig.model_validate(found.data)
    except ValidationError as exc:
        problems = problems + describe_validation_error(exc, ShardforgeConfig)
        raise ConfigError(source, problems) from None
    if problems:
        raise ConfigError(source, problems)
    return model


def validate_cfg(
    data: Mapping[str, Any], source: str = "<config>", command: str = "all"
) -> ShardforgeConfig:
    """Normalize and validate a raw mapping; all problems are raised at once as a ConfigError."""
    return _prepare(data, source, command, {})


def load_cfg(path: str | Path, command: str = "all", **overrides: Any) -> ShardforgeConfig:
    """Load, override, normalize and validate a YAML config; return it, read-only.

    Overrides are keyword arguments: ``load_cfg("cfg.yml", learning_rate=1e-4,
    fsdp={"offload_params": True})``; dotted names work through ``**{"fsdp.offload_params": True}``.
    `command` says what the config is for: ``"all"`` (default: every shardforge key is validated,
    Axolotl keys for features train lacks are accepted with a notice), ``"train"`` (those are
    errors), ``"merge"`` / ``"inspect"`` (only the keys that command reads are validated, so any
    Axolotl config loads). Every problem is reported at once in a ConfigError.

    The result reads as ``cfg.base_model``, ``cfg.fsdp.offload_params``, ``cfg["output_dir"]``,
    ``cfg.get("key")``; writing to it raises `ConfigReadOnlyError` (overrides go here instead).
    """
    return _prepare(read_yaml(path), str(path), command, overrides)


def read_cfg(config: str | Path | Mapping[str, Any], **overrides: Any) -> DictDefault:
    """The config as written (a YAML file, the one YAML file of a directory, or a mapping) with
    `overrides` applied, not validated: what Axolotl's `load_cfg` gives its callers. An
    override's nested key is dotted or, as Axolotl spells it, `parent__child`. Each command
    validates what it reads of it (`coerce_cfg`)."""
    if isinstance(config, Mapping):
        data, source = DictDefault(config).to_dict(), getattr(config, "source", "<config>")
    else:
        path = config_file(config)
        data, source = read_yaml(path), str(path)
    for dotted, value in _flatten(overrides).items():
        _set_dotted(data, dotted.replace("__", "."), value)
    return DictDefault(data, source)


# what commands and the Python API accept as a config
ConfigLike = ShardforgeConfig | Mapping[str, Any] | str | Path


def coerce_cfg(cfg: ConfigLike, command: str = "all") -> ShardforgeConfig:
    """Accept what users pass as `cfg`: load_cfg's result or a `ShardforgeConfig` (handed on as
    it is: it was validated once already), a mapping (an Axolotl-style `DictDefault` among
    them) or a path (read and validated for `command`)."""
    if isinstance(cfg, ShardforgeConfig):
        return cfg
    if isinstance(cfg, str | Path):
        return load_cfg(cfg, command=command)
    if isinstance(cfg, DictDefault):
        return validate_cfg(cfg.to_dict(), cfg.source, command)
    if isinstance(cfg, Mapping):
        return validate_cfg(cfg, command=command)
    raise TypeError(f"cfg must be a config path, a mapping or load_cfg()'s result, got {type(cfg)}")
