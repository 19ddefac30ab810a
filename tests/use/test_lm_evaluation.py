"""`shardforge lm-eval`: lm-evaluation-harness in this process over the model loaded once, on a
tiny local task (tests/use/data/tiny_choice.*, no hub): the same accuracy as the `lm_eval`
command on the same merged folder; Axolotl's `task:num_fewshot`; the results JSON and the
summary table; bad keys as one error line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from helpers.runs import Runs
from shardforge.cli.main import cli
from shardforge.errors import ConfigError
from shardforge.use.lm_evaluation import task_groups

DATA = Path(__file__).resolve().parent / "data"
TASK = "shardforge_tiny_choice"


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    """A folder holding the tiny task's YAML, its data file named by absolute path."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    text = (DATA / "tiny_choice.yaml").read_text()
    (folder / "tiny_choice.yaml").write_text(
        text.replace("DATA_FILE", str(DATA / "tiny_choice.jsonl"))
    )
    return folder


def run_config(runs: Runs, tmp_path: Path, **keys: Any) -> Path:
    data = yaml.safe_load(runs.full_cfg.read_text())
    data.update(output_dir=str(tmp_path / "out"), **keys)
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_task_groups_by_few_shot_count() -> None:
    assert task_groups(["a", "b:5", "c", "d:0"]) == {None: ["a", "c"], 5: ["b"], 0: ["d"]}
    with pytest.raises(ConfigError) as info:
        task_groups(["a", "b:five"])
    assert info.value.source == "lm_eval_tasks[1]" and "name:num_fewshot" in info.value.message


@pytest.mark.slow  # the runs are trained under torchrun; the lm_eval command is a process
def test_same_accuracy_as_the_lm_eval_command(runs: Runs, tasks: Path, tmp_path: Path) -> None:
    cfg = run_config(
        runs, tmp_path, lm_eval_tasks=[f"{TASK}:1"], lm_eval_include_path=str(tasks),
        lm_eval_batch_size=4,
    )  # fmt: skip
    result = CliRunner().invoke(cli, ["lm-eval", str(cfg), "--model_dir", str(runs.merged)])
    assert result.exit_code == 0, result.output
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert table[0].startswith("|") and "n-shot" in table[0] and TASK in table[2], result.stdout
    written = sorted((tmp_path / "out" / "lm_eval_results").glob("results-*.json"))
    assert len(written) == 1
    ours = json.loads(written[0].read_text())
    assert ours["n-shot"] == {TASK: 1}

    out = tmp_path / "cli"
    subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={runs.merged},dtype=float32", "--tasks", TASK, "--include_path", str(tasks),
         "--num_fewshot", "1", "--batch_size", "4", "--device", "cpu", "--output_path", str(out)],
        check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, timeout=400,
    )  # fmt: skip
    theirs = json.loads(next(out.rglob("results_*.json")).read_text())
    for metric in ("acc,none", "acc_stderr,none"):
        assert ours["results"][TASK][metric] == pytest.approx(
            theirs["results"][TASK][metric], abs=1e-9
        )
    assert ours["results"][TASK]["sample_len"] == theirs["results"][TASK]["sample_len"] == 12


def test_bad_keys_are_one_error_line(tmp_path: Path, tasks: Path) -> None:
    base = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "base"
    data = {"base_model": str(base), "output_dir": str(tmp_path / "out")}
    for keys, message in (
        ({}, "error: lm_eval_tasks: no tasks"),
        ({"lm_eval_tasks": ["x:y"]}, "error: lm_eval_tasks[0]"),
        ({"lm_eval_tasks": ["x"], "fewshot_as_multiturn": True}, "error: fewshot_as_multiturn"),
        (
            {"lm_eval_tasks": ["x"], "lm_eval_include_path": str(tmp_path / "no")},
            "error: lm_eval_include_path",
        ),
    ):
        cfg = tmp_path / "cfg.yml"
        cfg.write_text(yaml.safe_dump({**data, **keys}))
        result = CliRunner().invoke(cli, ["lm-eval", str(cfg), "--model_dir", str(base)])
        assert result.exit_code != 0 and result.stdout == "", result.output
        assert result.stderr.startswith(message), result.stderr
        assert "Traceback" not in result.stderr


def test_without_lm_eval_one_error_line_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "base"
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "lm_eval_tasks": ["x"]}))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval: ImportError
    result = CliRunner().invoke(cli, ["lm-eval", str(cfg), "--model_dir", str(base)])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: lm-eval needs lm-evaluation-harness, which is not installed: pip install "
        "'shardforge[eval]'"
    )
