"""`shardforge config-schema`: print the JSON schema of the config (for editors and docs)."""

from __future__ import annotations

import json

import click

from shardforge.config import ShardforgeConfig


def do_config_schema() -> str:
    """The config's JSON schema as indented text."""
    return json.dumps(ShardforgeConfig.model_json_schema(), indent=2)


@click.command(
    "config-schema",
    epilog="\b\nExamples:\n  shardforge config-schema > shardforge.schema.json\n",
    help="Print the JSON schema of shardforge configs: every key, its type, default and meaning.",
)
def command() -> None:
    click.echo(do_config_schema())


def do_cli() -> None:
    """fire entry point: python -m shardforge.cli.config_schema."""
    print(do_config_schema())


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
