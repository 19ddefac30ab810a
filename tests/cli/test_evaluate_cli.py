"""`shardforge evaluate`: the metrics on stdout (one JSON document with --json) equal what `train`
logged for the checkpoint given; bad inputs each give one `error:` line; --help with examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from helpers.runs import ROOT, Runs, trained_runs
from shardforge.cli.main import cli

BASE = ROOT / "examples" / "tiny-llama" / "base"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return trained_runs(tmp_path_factory)


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, ["evaluate", *map(str, args)])


@pytest.mark.slow  # the runs are trained under torchrun
def test_metrics_of_a_checkpoint_as_train_logged_them(runs: Runs) -> None:
    logged = runs.evals("full")
    checkpoint = runs.root / "full" / "checkpoint-2"
    result = invoke(runs.full_cfg, "--checkpoint", checkpoint, "--json")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert metrics["eval_loss"] == pytest.approx(logged[2]["eval_loss"], abs=1e-6)
    assert metrics["eval_perplexity"] == pytest.approx(logged[2]["eval_perplexity"], rel=1e-5)
    assert metrics["eval_tokens"] == logged[2]["eval_tokens"]
    assert f"model: {checkpoint}/model, merged on the fly (--checkpoint)" in result.stderr
    human = invoke(runs.full_cfg, "--step", "4", "--eval_batch_size", "3")  # other chunks
    assert human.exit_code == 0, human.output
    lines = dict(line.split(": ") for line in human.stdout.splitlines())
    assert list(lines) == ["eval_loss", "eval_perplexity", "eval_tokens"]
    assert float(lines["eval_loss"]) == pytest.approx(logged[4]["eval_loss"], abs=1e-6)


@pytest.mark.slow  # the runs are trained under torchrun
def test_base_model_names_the_model_to_evaluate(runs: Runs, tmp_path: Path) -> None:
    data = yaml.safe_load(runs.full_cfg.read_text())
    data["output_dir"] = str(tmp_path / "never-trained")
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump(data))
    result = invoke(cfg, "--base-model", runs.merged, "--json")
    assert result.exit_code == 0, result.output
    logged = runs.evals("full")[4]  # the merged model is checkpoint-4
    assert json.loads(result.stdout)["eval_loss"] == pytest.approx(logged["eval_loss"], abs=1e-5)
    assert f"model: {runs.merged} (--base_model)" in result.stderr


def test_no_evaluation_data_is_one_error(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(BASE), "output_dir": str(tmp_path)}))
    result = invoke(cfg, "--model_dir", BASE)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: val_set_size: the config has no evaluation data: set val_set_size (held out of "
        "datasets) or test_datasets"
    ]


def test_a_missing_checkpoint_step(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(BASE), "output_dir": str(tmp_path / "x")}))
    result = invoke(cfg, "--step", "7", "--val_set_size", "0.1")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: {tmp_path / 'x'}: no such directory: no checkpoint"
    ]


def test_help_shows_the_options_and_examples() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "Examples:" in result.output
    for option in ("--model_dir", "--lora_model_dir", "--checkpoint", "--step", "--json"):
        assert option in result.output
