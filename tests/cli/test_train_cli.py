"""`shardforge train`: help with examples, registration, errors without a traceback."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from shardforge.cli.main import cli
from shardforge.cli.train import command


def test_help_shows_examples_and_launch_options() -> None:
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert "shardforge train examples/tiny-llama.yml" in result.output
    for option in ("--launcher", "--nproc_per_node", "--nnodes", "--rdzv_endpoint", "--debug"):
        assert option in result.output


def test_registered_in_the_main_group() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert "train" in result.output and "FSDP2" in result.output


def test_missing_data_is_one_line_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "cfg.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "base_model": "examples/tiny-llama/base",
                "datasets": [{"path": "no/such.jsonl"}],
                "sequence_len": 64,
            }
        )
    )
    result = CliRunner().invoke(command, [str(config), "--launcher", "python"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {config}: datasets[0].path: data file no/such.jsonl not found; check the path"
    ]


def test_override_errors_name_the_key(tmp_path: Path) -> None:
    result = CliRunner().invoke(command, ["examples/tiny-llama.yml", "--sequence_len", "-1"])
    assert result.exit_code == 2
    assert "sequence_len" in result.output and "Traceback" not in result.output


def test_python_module_entry_point_reports_errors_in_one_line() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.cli.train",
            "examples/tiny-llama.yml",
            "--sequence_len",
            "0",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: examples/tiny-llama.yml: sequence_len: must be > 0, got 0"
    ]


def test_accelerates_launcher_spellings_point_to_ours() -> None:
    for spelling, ours in (("--num-processes", "--nproc_per_node"), ("--num_machines", "--nnodes")):
        result = CliRunner().invoke(command, ["examples/tiny-llama.yml", spelling, "2"])
        assert result.exit_code == 2
        assert result.output.strip() == (
            f"error: no such option {spelling} (accelerate's launcher spelling): use {ours}"
        )
