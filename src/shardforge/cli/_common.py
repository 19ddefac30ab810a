"""What every command shares: user-error handling, --debug, config overrides, fire entry points."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from shardforge.errors import ShardforgeError

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


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def run_guarded(fn: Callable[[], T], debug: bool = False) -> T:
    """Run a command body; a user error becomes `error: ...` on stderr and a non-zero exit."""
    try:
        return fn()
    except ShardforgeError as exc:
        if debug:
            raise
        fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        fail("interrupted", 130)


def split_debug(args: list[str]) -> tuple[list[str], bool]:
    """Pull a stray `--debug` out of the override arguments."""
    rest = [a for a in args if a != "--debug"]
    return rest, len(rest) != len(args)


def fire_overrides(kwargs: dict[str, Any]) -> list[str]:
    """fire passes `--key value` as kwargs; turn them back into override arguments."""
    out: list[str] = []
    for key, value in kwargs.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += [f"--{key}", text]
    return out
