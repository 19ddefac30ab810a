"""The `shardforge` command: a click group that maps command names to their modules.

Commands are imported only when used, so `shardforge --help` stays fast and torch-free.
"""

from __future__ import annotations

import importlib

import click

from shardforge.version import __version__

# command name -> module under shardforge.cli defining `command` (a click.Command)
COMMANDS: dict[str, str] = {
    "validate": "validate",
    "config-schema": "config_schema",
    "train": "train",
    "merge-sharded-fsdp-weights": "merge_sharded_fsdp_weights",
    "merge-lora": "merge_lora",
    "inspect": "inspect",
}

SUMMARIES: dict[str, str] = {
    "validate": "Validate a config and print it with defaults resolved.",
    "config-schema": "Print the JSON schema of the config.",
    "train": "Train with FSDP2 (starts torchrun itself); resumable sharded checkpoints.",
    "merge-sharded-fsdp-weights": "Merge a sharded FSDP checkpoint into a Hugging Face model.",
    "merge-lora": "Fuse a PEFT LoRA adapter into its base model: a Hugging Face model, streamed.",
    "inspect": "Describe a sharded checkpoint: layout, steps, world size, tensors, optimizer.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        cmd = importlib.import_module(f"shardforge.cli.{module}").command
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUMMARIES[name]) for name in COMMANDS])


EPILOG = """\b
Examples:
  shardforge validate examples/tiny-llama.yml
  shardforge config-schema > schema.json
Run `shardforge COMMAND --help` for a command's options and examples.
"""


@click.group(cls=LazyGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="shardforge")
def cli() -> None:
    """shardforge: config-first FSDP2 training and verified merges of sharded checkpoints.

    One YAML config drives every command.
    """


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
