"""`shardforge config-schema`: print the JSON schema of the config (for editors and docs), or
the Axolotl compatibility table (`--axolotl-table`)."""

from __future__ import annotations

import json

import click

from shardforge.cli._common import fire_entry, shardforge_command
from shardforge.config import ShardforgeConfig


def do_config_schema(axolotl_table: bool = False) -> str:
    """The config's JSON schema as indented text; or the Axolotl key table as markdown."""
    if axolotl_table:
        from shardforge.config.axolotl import compatibility_table

        return compatibility_table()
    return json.dumps(ShardforgeConfig.model_json_schema(), indent=2)


@shardforge_command(
    "config-schema",
    epilog="\b\nExamples:\n  shardforge config-schema > shardforge.schema.json\n"
    "  shardforge config-schema --axolotl-table   # every Axolotl key: implemented, ignored or "
    "not supported\n",
    overrides=False,
    params=[
        click.Option(
            ["--axolotl-table", "--axolotl_table", "axolotl_table"],
            is_flag=True,
            help="Print the Axolotl compatibility table (markdown, as in docs/config.md).",
        )
    ],
)
def command(axolotl_table: bool) -> str:
    """Print the JSON schema of shardforge configs: every key, its type, default and
    meaning. With --axolotl-table, print how each key of Axolotl's config is treated
    instead."""
    return do_config_schema(axolotl_table) + ("" if axolotl_table else "\n")


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
