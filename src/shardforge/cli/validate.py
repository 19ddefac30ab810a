"""`shardforge validate CONFIG`: check a config and print it with every default resolved."""

from __future__ import annotations

import logging
from pathlib import Path

import click
import yaml

from shardforge.cli._common import config_argument, fire_entry, load_config, shardforge_command

EPILOG = """\b
Examples:
  shardforge validate examples/tiny-llama.yml
  shardforge validate examples/tiny-llama.yml --learning_rate 1e-4 --fsdp.offload_params true
  shardforge validate axolotl-config.yml --for merge   # what the merge reads of it
  python -m shardforge.cli.validate examples/tiny-llama.yml
"""


FOR_COMMANDS = ("train", "merge", "merge-lora", "inspect")


def do_validate(
    config: str | Path, override_args: list[str] | None = None, for_command: str = "train"
) -> str:
    """Validate `config` (plus overrides) for one command; return the resolved config as YAML.

    train: every key, and Axolotl keys for features train lacks are errors, then every check
    train runs before it starts (base model, data files, tokenizer, wrap classes, attention,
    output_dir); merge, merge-lora and inspect: only the keys that command reads (any Axolotl
    config passes).
    """
    logger = logging.getLogger("shardforge")
    level = logger.level
    logger.setLevel(min(logger.getEffectiveLevel(), logging.DEBUG))  # every notice: the verdict
    try:
        cfg = load_config(config, override_args, for_command)
    finally:
        logger.setLevel(level)
    if for_command == "train":  # the checks train runs before it starts a rank, all of them
        from shardforge.train.preflight import preflight

        preflight(cfg, str(config))
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


@shardforge_command(
    "validate",
    epilog=EPILOG,
    params=[
        config_argument(),
        click.Option(
            ["--for", "for_command"],
            type=click.Choice(FOR_COMMANDS),
            default="train",
            show_default=True,
            help="The command the config is checked for.",
        ),
    ],
)
def command(config: str, for_command: str, overrides: list[str]) -> str:
    """Validate CONFIG for a command and print it with all defaults resolved (for merge,
    merge-lora and inspect: only the keys they read). Exit 0 when valid, 2 when not (every problem is
    listed). Axolotl configs are accepted: keys with no effect are named in a notice; for
    train, keys of features it does not support are errors, and every check train runs before
    starting runs too (base model, data files, wrap classes, attention, output_dir)."""
    return do_validate(config, overrides, for_command)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
