"""`shardforge preprocess`: help with examples, registration, what it prints, Axolotl's default
folder, errors as one line with nothing prepared, `--debug`, `python -m`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from helpers.tiny import make_tokenizer, tiny_texts, write_jsonl
from shardforge.cli.main import cli
from shardforge.cli.preprocess import command
from shardforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("preprocess")
    make_tokenizer(320).save_pretrained(root / "tok")
    write_jsonl(root / "texts.jsonl", [{"text": t} for t in tiny_texts(30, seed=6)])
    write_jsonl(root / "bad.jsonl", [{"text": "ok"}, {"body": "no text"}])
    return root


def _config(path: Path, data: Path, **extra: Any) -> Path:
    cfg = {
        "base_model": str(data / "tok"),
        "datasets": [{"path": str(data / "texts.jsonl"), "type": "completion"}],
        "sequence_len": 32,
        "sample_packing": True,
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_help_shows_examples_and_is_registered() -> None:
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "--debug" in result.output
    assert "shardforge preprocess examples/tiny-llama.yml" in result.output
    listed = CliRunner().invoke(cli, ["--help"]).output
    assert "preprocess" in listed and "dataset_prepared_path" in listed


def test_prints_the_folder_then_finds_it_up_to_date(data: Path, tmp_path: Path) -> None:
    config = _config(tmp_path / "cfg.yml", data, dataset_prepared_path=str(tmp_path / "prep"))
    first = CliRunner().invoke(cli, ["preprocess", str(config)])
    assert first.exit_code == 0, first.output
    (folder,) = [p for p in (tmp_path / "prep").iterdir() if p.is_dir()]
    line = f"prepared dataset {folder} (written): 46 training sequences of 32 tokens\n"
    assert first.stdout == line
    assert f"preparing the data sets into {folder} (hash {folder.name}): none prepared" in (
        first.stderr
    )
    assert "46 training sequences" not in first.stderr  # the result once: on stdout
    again = CliRunner().invoke(cli, ["preprocess", str(config)])
    assert again.stdout == line.replace("(written)", "(up to date)")
    assert str(folder) not in again.stderr
    longer = CliRunner().invoke(cli, ["preprocess", str(config), "--sequence_len", "48"])
    assert longer.exit_code == 0 and "sequence_len: 32 -> 48" in longer.stderr
    assert len([p for p in (tmp_path / "prep").iterdir() if p.is_dir()]) == 2


def test_without_the_key_it_prepares_into_axolotls_default_folder(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["preprocess", str(_config(tmp_path / "cfg.yml", data))])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("prepared dataset last_run_prepared/")
    assert "warning: dataset_prepared_path is not set; preparing into ./last_run_prepared" in (
        result.stderr
    )
    assert [p for p in (tmp_path / "last_run_prepared").iterdir() if p.is_dir()]


def test_errors_are_one_line_and_prepare_nothing(data: Path, tmp_path: Path) -> None:
    prep = tmp_path / "prep"
    missing = _config(
        tmp_path / "missing.yml",
        data,
        dataset_prepared_path=str(prep),
        datasets=[{"path": str(tmp_path / "no.jsonl")}],
    )
    result = CliRunner().invoke(command, [str(missing)])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: {missing}: datasets[0].path: data file {tmp_path / 'no.jsonl'} not found; "
        "check the path"
    ]
    assert not prep.exists()

    bad = _config(
        tmp_path / "bad.yml",
        data,
        dataset_prepared_path=str(prep),
        datasets=[{"path": str(data / "bad.jsonl")}],
    )
    result = CliRunner().invoke(command, [str(bad)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: datasets[0].field: row 2 of {data / 'bad.jsonl'}: no text in "
        "'text' (the row's keys: body)"
    ]
    assert "Traceback" not in result.output
    assert not [p for p in prep.iterdir() if not p.name.endswith(".lock")]  # no folder, no temp

    debug = CliRunner().invoke(command, [str(bad), "--debug"])
    assert isinstance(debug.exception, ConfigError)


@pytest.mark.slow
def test_python_module_entry_point(data: Path, tmp_path: Path) -> None:
    config = _config(tmp_path / "cfg.yml", data, dataset_prepared_path=str(tmp_path / "prep"))
    proc = subprocess.run(
        [sys.executable, "-m", "shardforge.cli.preprocess", str(config), "--sequence_len", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {config}: sequence_len: must be > 0, got 0"
    ]
    ok = subprocess.run(
        [sys.executable, "-m", "shardforge.cli.preprocess", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"prepared dataset {tmp_path / 'prep'}/")
