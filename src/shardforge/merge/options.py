"""Options written once: a request dataclass's fields carry their help text and CLI facts, and
the command-line options, `--help`, the Python keywords (with their signature and docstring)
and the docs table are derived from them.

    @dataclass(frozen=True)
    class Request:
        step: int | None = optional("Merge this step instead of the latest.", type=int)

A field without `option(...)` metadata (`optional`, `flag`) is not an option. A bool field is a flag (`--verify`,
declared with `flag(...)`); one that defaults to True also takes its negation
(`--no_save_tokenizer`). Every multi-word option takes both spellings users type:
`--output_path` and `--output-path`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.errors import MergeError

# the key of a field's metadata holding its `Option`
OPTION = "shardforge.option"
# the group of torchrun's options, passed through as they are
TORCHRUN = "torchrun"
# what the help of each group's options says after their own words
GROUP_NOTES: dict[str, str] = {TORCHRUN: "Passed to torchrun."}


@dataclass(frozen=True)
class Option:
    """What a request field is to users: its help text and how it is typed on the command line."""

    help: str
    # the command-line name, if not the field's (`--format` for `output_format`)
    cli_name: str | None = None
    # the value's type on the command line: int, or None (a string); bool fields are flags
    type: type | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    # (value, flag) -> the field's value, from what the command line or Python gave; may raise
    # MergeError (reported with the other problems of the request)
    parse: Callable[[Any, str], Any] | None = None
    # False: a Python keyword only (not on the command line)
    cli: bool = True
    # a group of options (TORCHRUN: passed through to torchrun), noted in their help
    group: str | None = None
    # more for the docs table (markdown; links welcome), after `help`
    doc: str = ""
    # the Python annotation shown by `signature`, where the field's own is narrower (a path
    # given as a string is made a Path)
    annotation: str | None = None
    # True: repeatable on the command line (`--keep_dtype a --keep_dtype b`), a tuple of them
    multiple: bool = False


def option(help: str, **facts: Any) -> dict[str, Option]:
    """The metadata of an option field: `field(default=None, metadata=option("...", type=int))`
    (`facts`: Option's other fields)."""
    return {OPTION: Option(help, **facts)}


def optional(help: str, default: Any = None, **facts: Any) -> Any:
    """An option's field: `step: int | None = optional("Merge this step ...", type=int)` is
    `field(default=None, metadata=option("Merge this step ...", type=int))`."""
    return dataclasses.field(default=default, metadata=option(help, **facts))


def flag(help: str, default: bool = False, **facts: Any) -> Any:
    """A flag's field: `verify: bool = flag("Re-read the output ...")` is
    `field(default=False, metadata=option("Re-read the output ..."))`."""
    return dataclasses.field(default=default, metadata=option(help, **facts))


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of request class `cls` that are options, in order."""
    return [f for f in dataclasses.fields(cls) if OPTION in f.metadata]


def option_of(f: dataclasses.Field[Any]) -> Option:
    opt = f.metadata[OPTION]
    assert isinstance(opt, Option)
    return opt


def help_text(f: dataclasses.Field[Any]) -> str:
    """The help of option field `f` (--help, the docstring, the docs), its group's note after it."""
    opt = option_of(f)
    note = GROUP_NOTES.get(opt.group or "")
    return f"{opt.help} {note}" if note else opt.help


def is_flag(f: dataclasses.Field[Any]) -> bool:
    return isinstance(f.default, bool)


def flags(f: dataclasses.Field[Any]) -> list[str]:
    """The command-line spellings of `f`: `--output_path`, `--output-path`; a flag defaulting
    to True as click's on/off pairs (`--save_tokenizer/--no_save_tokenizer`)."""
    name = option_of(f).cli_name or f.name
    dashed = name.replace("_", "-")
    if is_flag(f) and f.default:
        return (
            [f"--{dashed}/--no-{dashed}", f"--{name}/--no_{name}"]
            if dashed != name
            else [f"--{name}/--no-{name}"]
        )
    return [f"--{name}", f"--{dashed}"] if dashed != name else [f"--{name}"]


def spellings(f: dataclasses.Field[Any]) -> list[str]:
    """What users type to set `f`: `--output_path`, `--output-path`; `--no_save_tokenizer`,
    `--no-save-tokenizer` for a flag that is on by default."""
    name = option_of(f).cli_name or f.name
    if is_flag(f) and f.default:
        name = f"no_{name}"
    dashed = name.replace("_", "-")
    return [f"--{name}", f"--{dashed}"] if dashed != name else [f"--{name}"]


def main_flag(f: dataclasses.Field[Any]) -> str:
    """`--output_path`: the spelling messages use."""
    return f"--{option_of(f).cli_name or f.name}"


def parse_fields(request: Any) -> list[str]:
    """Set each option field of the frozen `request` to its parsed value (its default where the
    value cannot be parsed); the problems found."""
    problems: list[str] = []
    for f in option_fields(type(request)):
        parse = option_of(f).parse
        if parse is None:
            continue
        try:
            object.__setattr__(request, f.name, parse(getattr(request, f.name), main_flag(f)))
        except MergeError as exc:  # reported; the other checks see the default
            problems.append(exc.message)
            object.__setattr__(request, f.name, f.default)
    return problems


def one_error(problems: Sequence[str], what: str) -> MergeError:
    """The problems of a request as one error: the problem itself when there is one, else how
    many `what` there are and each on its own line."""
    if len(problems) == 1:
        return MergeError(problems[0])
    return MergeError(f"{len(problems)} {what}:", [f"- {p}" for p in problems])


# --- parsers (value, flag) -> value ---


def parse_path(value: Any, flag: str) -> Path | None:
    return None if value is None else Path(value).absolute()


def parse_local_path(value: Any, flag: str) -> Path | None:
    """`parse_path` of an option read as local files only (a Path would fold ``s3://``)."""
    from shardforge.config.schema import names_object_storage

    if names_object_storage(value):
        raise MergeError(
            f"{flag} {value}: the model is loaded from local files; merge it from the store "
            "first (shardforge merge-sharded-fsdp-weights CFG --output_path DIR), then pass "
            "--model_dir DIR"
        )
    return parse_path(value, flag)


def parse_steps(value: Any, flag: str) -> tuple[int, ...]:
    """`100,200,300` (the command line), a list or tuple of ints, one int, or None."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list | tuple):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        raise MergeError(f"{flag} {value!r}: expected step numbers like 100,200,300")
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise MergeError(f"{flag} {value!r}: expected step numbers like 100,200,300")
    return tuple(int(p) for p in parts)


def parse_size(value: Any, flag: str) -> int | str | None:
    """`5GB` stays as it is; `1000000` (bytes, typed on the command line) becomes an int."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def parse_texts(value: Any, flag: str) -> tuple[str, ...]:
    """A repeatable option's values: a tuple (the command line), a list, or one string."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise MergeError(f"{flag} {value!r}: expected a string or a list of strings")


def parse_text(value: Any, flag: str) -> str | None:
    """A value passed on as text (torchrun's `--nnodes 2`)."""
    return None if value is None else str(value)


# --- the Python side: keywords, signature, docstring ---


def check_keywords(cls: type, given: Iterable[str], function: str) -> None:
    """A TypeError naming the first keyword that is no field of `cls`, with a did-you-mean."""
    names = [f.name for f in option_fields(cls)]
    for key in given:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}{hint}")


def signature(
    cls: type, leading: Sequence[inspect.Parameter], positional: Sequence[str], returns: Any
) -> inspect.Signature:
    """`leading` parameters, then the fields named in `positional` (positional or keyword),
    then every other option field of `cls` as a keyword-only parameter, each with its default
    and annotation."""
    by_name = {f.name: f for f in option_fields(cls)}
    params = list(leading)
    for name in positional:
        f = by_name[name]
        params.append(_parameter(f, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    for f in by_name.values():
        if f.name not in positional:
            params.append(_parameter(f, inspect.Parameter.KEYWORD_ONLY))
    return inspect.Signature(params, return_annotation=returns)


def _parameter(f: dataclasses.Field[Any], kind: Any) -> inspect.Parameter:
    annotation = option_of(f).annotation or f.type
    return inspect.Parameter(f.name, kind, default=f.default, annotation=annotation)


def docstring_args(cls: type, indent: str = "        ", width: int = 96) -> str:
    """`name: help` for every option field of `cls`, wrapped as a Google-style Args list."""
    lines = []
    for f in option_fields(cls):
        text = f"{f.name}: {help_text(f)}"
        lines += textwrap.wrap(
            text, width, initial_indent=indent, subsequent_indent=indent + "    "
        )
    return "\n".join(lines)


# --- the docs table ---


def _cell(text: str) -> str:
    for raw, escaped in (("|", "\\|"), ("<", "\\<"), (">", "\\>"), ("\n", " ")):
        text = text.replace(raw, escaped)
    return text.strip()


def markdown_table(cls: type) -> str:
    """The option table of `cls` for the docs: command-line spellings, Python keyword and
    default, meaning (`help`, then `doc`)."""
    rows = ["| option | Python keyword | meaning |", "| --- | --- | --- |"]
    for f in option_fields(cls):
        opt = option_of(f)
        if opt.cli:
            value = "" if is_flag(f) else f" {opt.metavar or '|'.join(opt.choices) or 'VALUE'}"
            cli = ", ".join(f"`{s}{value}`" for s in spellings(f))
            cli += " (repeatable)" if opt.multiple else ""
        else:
            cli = "(Python only)"
        python = f"`{f.name}={f.default!r}`"
        meaning = " ".join(p for p in (help_text(f), opt.doc) if p)
        rows.append(f"| {_cell(cli)} | {_cell(python)} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"
