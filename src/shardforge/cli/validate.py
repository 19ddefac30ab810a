"""`shardforge validate CONFIG`: check a config and print it with every default resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from shardforge.cli._common import (
    OVERRIDE_CONTEXT,
    OVERRIDES_HELP,
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
  python -m shardforge.cli.validate examples/tiny-llama.yml
"""


def do_validate(config: str | Path, override_args: list[str] | None = None) -> str:
    """Validate `config` (plus overrides) and return the resolved config as YAML text."""
    overrides = parse_override_args(override_args or [])
    cfg = load_cfg(config, **overrides)
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


@click.command(
    "validate",
    context_settings=OVERRIDE_CONTEXT,
    epilog=EPILOG,
    help="Validate CONFIG and print it with all defaults resolved. Exit 0 when valid, 2 when "
    "not (every problem is listed). " + OVERRIDES_HELP,
)
@click.argument("config", type=click.Path(dir_okay=False))
@debug_option()
@click.pass_context
def command(ctx: click.Context, config: str, debug: bool) -> None:
    args, stray_debug = split_debug(list(ctx.args))
    setup_logging()
    text = run_guarded(lambda: do_validate(config, args), debug or stray_debug)
    click.echo(text, nl=False)


def do_cli(config: str, debug: bool = False, **kwargs: Any) -> None:
    """fire entry point: python -m shardforge.cli.validate CONFIG [--key value ...]."""
    setup_logging()
    text = run_guarded(lambda: do_validate(config, fire_overrides(kwargs)), debug)
    print(text, end="")


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
