"""What every command shares: user-error handling, --debug, config overrides, fire entry points."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from shardforge.errors import ShardforgeError, format_error

T = TypeVar("T")

OVERRIDES_HELP = (
    "Any config key can be overridden after the config path: `--learning_rate 2e-5`, "
    "`--fsdp.offload_params true` (dots for nested keys), `--bf16` (a bare flag means true)."
)

# Extra arguments (config overrides) are collected instead of rejected.
OVERRIDE_CONTEXT: dict[str, Any] = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": ["-h", "--help"],
}


def spelled_option(name: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    """A click option taking both spellings users type: `--output_path` and `--output-path`."""
    dashed = name.replace("_", "-")
    flags = [f"--{name}", f"--{dashed}"] if dashed != name else [f"--{name}"]
    return click.option(*flags, name, **kwargs)


def debug_option() -> Callable[[Callable[..., Any]], Any]:
    """`--debug`: show the traceback of a user error instead of the one-line message."""
    return click.option("--debug", is_flag=True, help="Show a traceback on errors.")


def setup_logging(quiet: bool = False) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
        force=True,
    )


def fail(message: str, code: int = 1, details: Sequence[str] = ()) -> NoReturn:
    """Print `error: <message>` (one line of at most 300 characters, printable) and its
    indented details (at most 20, then "(+N more)") on stderr; exit with `code`."""
    for line in format_error(message, details):
        click.echo(line, err=True)
    raise SystemExit(code)


def os_error_message(exc: OSError) -> str:
    """`<file>: <reason>` for an OSError that reached the command unconverted."""
    where = exc.filename if exc.filename is not None else None
    reason = exc.strerror or type(exc).__name__
    target = f" -> {exc.filename2}" if exc.filename2 is not None else ""
    return f"{where}{target}: {reason}" if where is not None else f"{reason} ({exc})"


def run_guarded(fn: Callable[[], T], debug: bool = False) -> T:
    """Run a command body; a user error (or a file-system error nothing converted) becomes
    `error: ...` on stderr and a non-zero exit."""
    try:
        return fn()
    except ShardforgeError as exc:
        if debug:
            raise
        fail(exc.message, exc.exit_code, exc.details)
    except OSError as exc:
        if debug:
            raise
        fail(f"{os_error_message(exc)} (--debug shows the traceback)", 1)
    except KeyboardInterrupt:
        if debug:
            raise
        fail("interrupted", 130)


def split_debug(args: list[str]) -> tuple[list[str], bool]:
    """Pull a stray `--debug` out of the override arguments."""
    rest = [a for a in args if a != "--debug"]
    return rest, len(rest) != len(args)


def _option_names(command: click.Command) -> list[str]:
    return [o for p in command.params if isinstance(p, click.Option) for o in p.opts]


def check_options(ctx: click.Context, args: list[str]) -> list[str]:
    """The extra arguments of a command, all of which must be config overrides.

    An argument that names neither an option of the command nor a config key (shardforge's or
    Axolotl's) is an option error with a suggestion among the command's options, so `--verfy`
    reads "no such option --verfy; did you mean --verify?" rather than an unknown config key.
    """
    import difflib

    from shardforge.config.axolotl import known_top_level_keys

    keys = known_top_level_keys()
    options = _option_names(ctx.command)
    for arg in args:
        if not arg.startswith("--") or len(arg) == 2:
            continue
        name = arg[2:].split("=", 1)[0]
        key = name.replace("-", "_").split(".", 1)[0]
        if key in keys:
            continue
        close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.7)
        if close:
            fail(f"no such option --{name}; did you mean {close[0]}?", 2)
        near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.75)
        hint = f"; did you mean the config key --{near[0]}?" if near else ""
        fail(
            f"no such option --{name} (neither an option of `{ctx.command.name}` nor a config "
            f"key){hint}\n  see `shardforge {ctx.command.name} --help` and docs/config.md",
            2,
        )
    return args


def fire_overrides(kwargs: dict[str, Any]) -> list[str]:
    """fire passes `--key value` as kwargs; turn them back into override arguments."""
    out: list[str] = []
    for key, value in kwargs.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += [f"--{key}", text]
    return out
