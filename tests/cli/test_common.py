"""The one wrapper every command shares (cli/_common.py): --debug, config overrides checked,
user errors as one `error:` line with their exit code, the body's text on stdout; and the fire
entry point (`python -m shardforge.cli.<module>`) run as the same command line."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner

from shardforge.cli._common import fire_argv, fire_entry, shardforge_command
from shardforge.cli.main import COMMANDS
from shardforge.errors import ConfigError, MergeError


def _demo(body: Any) -> click.Command:
    return shardforge_command(
        "demo",
        epilog="",
        params=[click.Argument(["config"]), click.Option(["--verify"], is_flag=True)],
    )(body)


def test_the_body_gets_its_parameters_and_the_checked_overrides() -> None:
    seen: dict[str, Any] = {}

    def body(config: str, verify: bool, overrides: list[str], debug: bool) -> str:
        """A demo command."""
        seen.update(config=config, verify=verify, overrides=overrides, debug=debug)
        return "done\n"

    result = CliRunner().invoke(_demo(body), ["cfg.yml", "--learning_rate", "1e-3", "--debug"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "done\n"
    assert seen == {
        "config": "cfg.yml",
        "verify": False,
        "overrides": ["--learning_rate", "1e-3"],
        "debug": True,
    }
    # a stray --debug among the overrides counts too
    CliRunner().invoke(_demo(body), ["cfg.yml", "--verify", "--seed", "1", "--debug"])
    assert seen["debug"] and seen["verify"] and seen["overrides"] == ["--seed", "1"]


@pytest.mark.parametrize(
    ("error", "code"), [(MergeError("bad merge", ["a detail"]), 1), (ConfigError("x", ["y"]), 2)]
)
def test_a_user_error_is_one_line_with_its_exit_code(error: Exception, code: int) -> None:
    def body(config: str, verify: bool, overrides: list[str]) -> None:
        """A demo command."""
        raise error

    result = CliRunner().invoke(_demo(body), ["cfg.yml"])
    assert result.exit_code == code
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    with pytest.raises(type(error)):  # --debug: the exception itself
        CliRunner().invoke(_demo(body), ["cfg.yml", "--debug"], catch_exceptions=False)


def test_a_mistyped_option_is_an_option_error() -> None:
    def body(config: str, verify: bool, overrides: list[str]) -> None:
        """A demo command."""

    result = CliRunner().invoke(_demo(body), ["cfg.yml", "--verfy"])
    assert result.exit_code == 2
    assert "no such option --verfy; did you mean --verify?" in result.stderr


def test_fire_arguments_become_the_command_line() -> None:
    from shardforge.cli.merge_sharded_fsdp_weights import command

    argv = fire_argv(
        command,
        ["cfg.yml"],
        {
            "output-path": "out",
            "format": "torch",
            "no_save_tokenizer": True,
            "verify": True,
            "dry_run": False,
            "steps": (100, 200),
            "keep_dtype": ["router", "norm"],
            "max_shard_size": 1000,
            "learning_rate": 2e-5,
            "bf16": True,
        },
    )
    assert argv == [
        "cfg.yml",
        *("--output_path", "out", "--format", "torch", "--no-save-tokenizer", "--verify"),
        *("--steps", "100,200", "--keep_dtype", "router", "--keep_dtype", "norm"),
        *("--max_shard_size", "1000"),
        *("--learning_rate", "2e-05", "--bf16", "true"),
    ]


def test_every_command_has_one_fire_entry_of_its_own() -> None:
    import importlib

    for module in COMMANDS.values():
        mod = importlib.import_module(f"shardforge.cli.{module}")
        assert isinstance(mod.command, click.Command)
        assert mod.do_cli.__doc__ == fire_entry(mod.command).__doc__
        assert any(p.name == "debug" for p in mod.command.params), module


def test_quiet_libraries_leaves_the_process_as_it_was() -> None:
    import os

    from transformers.utils import logging as tlog

    from shardforge.cli._common import QUIET_ENV, quiet_libraries

    before = (tlog.get_verbosity(), tlog.is_progress_bar_enabled())
    env = {k: os.environ.get(k) for k in QUIET_ENV}
    with quiet_libraries():
        assert tlog.get_verbosity() == tlog.ERROR and not tlog.is_progress_bar_enabled()
        assert all(os.environ[k] == v for k, v in QUIET_ENV.items())
    assert (tlog.get_verbosity(), tlog.is_progress_bar_enabled()) == before
    assert {k: os.environ.get(k) for k in QUIET_ENV} == env
