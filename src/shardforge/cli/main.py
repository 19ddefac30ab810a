"""The `shardforge` command: a click group that maps command names to their modules.

Commands are imported only when used, so `shardforge --help` stays fast and torch-free.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
from typing import NoReturn

import click

from shardforge.startup import lazy_packages, relaxed_gc
from shardforge.version import __version__

# command name -> module under shardforge.cli defining `command` (a click.Command)
COMMANDS: dict[str, str] = {
    "validate": "validate",
    "config-schema": "config_schema",
    "preprocess": "preprocess",
    "train": "train",
    "merge-sharded-fsdp-weights": "merge_sharded_fsdp_weights",
    "merge-lora": "merge_lora",
    "inspect": "inspect",
    "inference": "inference",
    "evaluate": "evaluate",
    "lm-eval": "lm_eval",
    "quantize": "quantize",
    "fetch": "fetch",
    "verify": "verify",
}

SUMMARIES: dict[str, str] = {
    "validate": "Validate a config and print it with defaults resolved.",
    "config-schema": "Print the JSON schema of the config.",
    "preprocess": "Tokenize and pack the data sets once into dataset_prepared_path for train.",
    "train": "Train with FSDP2 (starts torchrun itself); resumable sharded checkpoints.",
    "merge-sharded-fsdp-weights": "Merge a sharded FSDP checkpoint into a Hugging Face model.",
    "merge-lora": "Fuse a PEFT LoRA adapter into its base model: a Hugging Face model, streamed.",
    "inspect": "Describe a sharded checkpoint: layout, steps, world size, tensors, optimizer.",
    "inference": "Generate from the trained model: merged, a checkpoint, or base + LoRA adapter.",
    "evaluate": "Eval loss and perplexity of the trained model on the config's evaluation data.",
    "lm-eval": "lm-evaluation-harness over the trained model, in-process (the eval extra).",
    "quantize": "torchao int8/int4 weight-only quantization of the model (the quant extra).",
    "fetch": "Copy the shipped examples or docs into a folder.",
    "verify": "Check a merged model directory against its shardforge-manifest.json.",
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


def main() -> NoReturn:
    """The console entry point: `cli`, then `exit_now` with its exit status."""
    lazy_packages()  # the lighter start-up (`shardforge.startup`): no package loaded unused,
    try:  # no full collections while torch and transformers import
        with relaxed_gc():
            cli()
    except SystemExit as exc:
        exit_now(exc.code)
    exit_now(0)


def exit_now(code: object) -> NoReturn:
    """Leave without the interpreter's teardown of every module: with torch and transformers
    loaded it took 1.2 s after a merge had finished (its output fsynced and published), a
    second the user waits for and nothing needs. What a normal exit does before that teardown
    still happens, in its order: threading's exit hooks (idle thread pools end), a wait for
    every non-daemon thread, the exit handlers; then every stream is flushed. A non-integer
    status (or a Python without `threading._shutdown`) is a normal `sys.exit`."""
    shutdown = getattr(threading, "_shutdown", None)
    if not isinstance(code, int | None) or shutdown is None:
        raise SystemExit(code)
    shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            code = code or 1
    os._exit(code or 0)


if __name__ == "__main__":
    main()
