from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from shardforge.cli.validate import command, do_validate

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-llama.yml"


def test_prints_resolved_config() -> None:
    result = CliRunner().invoke(command, [str(TINY)])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert resolved["base_model"] == "examples/tiny-llama/base"
    assert resolved["fsdp"]["offload_params"] is False  # a default, filled in
    assert resolved["trust_remote_code"] is False


def test_overrides_after_the_config_path() -> None:
    result = CliRunner().invoke(
        command, [str(TINY), "--learning_rate", "2e-5", "--fsdp.reshard_after_forward", "false"]
    )
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output)
    assert resolved["learning_rate"] == 2e-5
    assert resolved["fsdp"]["reshard_after_forward"] is False


def test_bad_override_is_reported_like_a_bad_key() -> None:
    result = CliRunner().invoke(command, [str(TINY), "--fsdp.offload_params", "maybe"])
    assert result.exit_code == 2
    assert "fsdp.offload_params: expected a boolean (true/false), got 'maybe'" in result.output
    assert "Traceback" not in result.output


def test_all_problems_at_once(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text("learnig_rate: 1\nsequence_len: -3\n")
    result = CliRunner().invoke(command, [str(cfg)])
    assert result.exit_code == 2
    assert "3 problems" in result.output
    for needle in (
        "base_model: required",
        "learnig_rate: unknown key",
        "sequence_len: must be > 0",
    ):
        assert needle in result.output


def test_yaml_syntax_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text("base_model: m\n  x: [1,\n")
    result = CliRunner().invoke(command, [str(cfg)])
    assert result.exit_code == 2
    assert f"{cfg}:2:4: invalid YAML" in result.output


def test_do_validate_function() -> None:
    text = do_validate(TINY, ["--max_steps", "7"])
    assert yaml.safe_load(text)["max_steps"] == 7


def test_fire_module_entry_point() -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.cli.validate",
            "examples/tiny-llama.yml",
            "--learning_rate",
            "0.001",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["learning_rate"] == 0.001


def test_fire_module_reports_errors_without_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text("base_model: m\nlearnig_rate: 1\n")
    bad = subprocess.run(
        [sys.executable, "-m", "shardforge.cli.validate", str(cfg)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "did you mean 'learning_rate'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_for_merge_lora_reads_only_its_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "lora.yml"
    cfg.write_text(
        "base_model: m\noutput_dir: out\nlora_model_dir: out/adapter\nlora_r: not-a-number\n"
        "optimizer: adamw_anyprecision\nchat_template: gemma3\n"
    )
    result = CliRunner().invoke(command, [str(cfg), "--for", "merge-lora"])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["lora_model_dir"] == "out/adapter"
    # the keys merge-lora does not read are not taken (their defaults are shown)
    assert resolved["lora_r"] == 8 and resolved["optimizer"] == "adamw_torch"
    assert "uses 4 of the config's 6 top-level keys" in result.stderr
    refused = CliRunner().invoke(command, [str(cfg), "--for", "train"])
    assert refused.exit_code == 2 and "lora_r" in refused.output
