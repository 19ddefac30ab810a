"""`shardforge validate CONFIG`: check a config and print it with every default resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from shardforge.cli._common import (
    OVERRIDE_CONTEXT,
    OVERRIDES_HELP,
    check_options,
    debug_option,
    fire_overrides,
    run_guarded,
    setup_logging,
    split_debug,
)
from shardforge.config import load_cfg, parse_override_args

EPILOG = """\b
Examples:
  shardforge validate examples/tiny-llama.yml
  shardforge validate examples/tiny-llama.yml --learning_rate 1e-4 --fsdp.offload_params true
  shardforge validate axolotl-config.yml --for merge   # what the merge reads of it
  python -m shardforge.cli.validate examples/tiny-llama.yml
"""


FOR_COMMANDS = ("train", "merge", "inspect")


def do_validate(
    config: str | Path, override_args: list[str] | None = None, for_command: str = "train"
) -> str:
    """Validate `config` (plus overrides) for one command; return the resolved config as YAML.

    train: every key, and Axolotl keys for features train lacks are errors; merge / inspect:
    only the keys that command reads (any Axolotl config passes).
    """
    overrides = parse_override_args(override_args or [])
    cfg = load_cfg(config, command=for_command, **overrides)
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


@click.command(
    "validate",
    context_settings=OVERRIDE_CONTEXT,
    epilog=EPILOG,
    help="Validate CONFIG for a command and print it with all defaults resolved (for merge and "
    "inspect: only the keys they read). Exit 0 when valid, 2 when not (every problem is "
    "listed). Axolotl configs are accepted: keys with no effect are named in a notice; for "
    "train, keys of features it does not support are errors. " + OVERRIDES_HELP,
)
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--for",
    "for_command",
    type=click.Choice(FOR_COMMANDS),
    default="train",
    show_default=True,
    help="The command the config is checked for.",
)
@debug_option()
@click.pass_context
def command(ctx: click.Context, config: str, for_command: str, debug: bool) -> None:
    args, stray_debug = split_debug(list(ctx.args))
    setup_logging()
    args = check_options(ctx, args)
    text = run_guarded(lambda: do_validate(config, args, for_command), debug or stray_debug)
    click.echo(text, nl=False)


def do_cli(config: str, debug: bool = False, **kwargs: Any) -> None:
    """fire entry point: python -m shardforge.cli.validate CONFIG [--for merge] [--key value]."""
    setup_logging()
    for_command = str(kwargs.pop("for", "train"))
    text = run_guarded(lambda: do_validate(config, fire_overrides(kwargs), for_command), debug)
    print(text, end="")


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
