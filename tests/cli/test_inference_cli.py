"""`shardforge inference`: the new text streamed to stdout (what was loaded on stderr), the prompt
from --prompt or standard input; bad inputs each give one `error:` line and a non-zero exit;
--help with examples and without torch; the fire entry point."""

from __future__ import annotations

import subprocess
import sys
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


def invoke(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(cli, ["inference", *map(str, args)], input=stdin)


def one_line_error(result: Any) -> str:
    assert result.exit_code != 0 and result.stdout == "", result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(errors) == 1 and len(lines[errors[0]]) <= 300, result.stderr
    assert all(d.startswith("  ") for d in lines[errors[0] + 1 :]), result.stderr
    assert "Traceback" not in result.stderr
    return "\n".join(lines[errors[0] :])


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    path = tmp_path / "cfg.yml"
    data = {"base_model": str(BASE), "output_dir": str(tmp_path / "out")}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow  # the runs are trained under torchrun
def test_streams_the_greedy_answer_from_prompt_or_stdin(runs: Runs) -> None:
    from shardforge.config import load_cfg
    from shardforge.use.inference import inference

    args = (runs.full_cfg, "--model_dir", runs.merged, "--max_new_tokens", "16")
    result = invoke(*args, "--prompt", "The robot")
    assert result.exit_code == 0, result.output
    want = inference(load_cfg(runs.full_cfg), "The robot", model_dir=runs.merged, max_new_tokens=16)
    assert result.stdout == want.text + "\n"
    assert f"model: {runs.merged} (--model_dir)" in result.stderr
    piped = invoke(*args, stdin="The robot\n")  # one line end dropped
    assert piped.exit_code == 0, piped.output
    assert piped.stdout == result.stdout


@pytest.mark.slow  # the runs are trained under torchrun
def test_base_model_loads_the_merged_model_as_axolotl_does(runs: Runs, tmp_path: Path) -> None:
    data = yaml.safe_load(runs.full_cfg.read_text())
    data["output_dir"] = str(tmp_path / "never-trained")  # nothing to find there
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump(data))
    want = invoke(runs.full_cfg, "--model_dir", runs.merged, "--prompt", "The robot")
    assert want.exit_code == 0, want.output
    for spelling in ("--base_model", "--base-model"):
        result = invoke(cfg, spelling, runs.merged, "--prompt", "The robot")
        assert result.exit_code == 0, result.output
        assert result.stdout == want.stdout
        assert f"model: {runs.merged} (--base_model)" in result.stderr
    # the run's checkpoints are there, but the named model is loaded
    result = invoke(runs.full_cfg, f"--base-model={runs.merged}", "--prompt", "The robot")
    assert result.exit_code == 0 and "merged on the fly" not in result.stderr, result.output


def test_a_missing_model_directory(cfg: Path, tmp_path: Path) -> None:
    error = one_line_error(invoke(cfg, "--model_dir", tmp_path / "nowhere", "--prompt", "Hi"))
    assert (
        error
        == f"error: {tmp_path / 'nowhere'}: model directory not found (--model_dir); check the path"
    )


def test_no_checkpoint_names_the_options(cfg: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    error = one_line_error(invoke(cfg, "--prompt", "Hi"))
    assert error.splitlines() == [
        f"error: {tmp_path / 'out'}: an empty directory: the run has no checkpoint yet (train first)",
        "  or name the model: --model_dir DIR, --lora_model_dir DIR or --checkpoint PATH",
    ]


def test_an_empty_prompt_is_refused_before_the_model_loads(cfg: Path) -> None:
    for stdin in ("", "\n", "  \n"):
        error = one_line_error(invoke(cfg, "--model_dir", BASE, stdin=stdin))
        assert error == "error: empty prompt: give --prompt TEXT or the prompt on standard input"
        assert "model:" not in error


def test_sampling_options_need_do_sample(cfg: Path) -> None:
    error = one_line_error(invoke(cfg, "--model_dir", BASE, "--prompt", "Hi", "--top_p", "0.9"))
    assert error.startswith("error: --top_p only apply to sampling: add --do_sample")
    error = one_line_error(invoke(cfg, "--model_dir", BASE, "--lora_model_dir", BASE))
    assert "--model_dir and --lora_model_dir each name the model" in error


def test_debug_raises_the_error(cfg: Path, tmp_path: Path) -> None:
    result = invoke(cfg, "--model_dir", tmp_path / "nowhere", "--prompt", "Hi", "--debug")
    assert result.exit_code != 0
    assert "model directory not found" in str(result.exception)


def test_help_shows_the_options_and_examples() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert "Examples:" in result.output
    for option in ("--model_dir", "--lora_model_dir", "--checkpoint", "--step", "--prompt"):
        assert option in result.output
    for option in ("--do_sample", "--temperature", "--top_p", "--top_k", "--max_new_tokens"):
        assert option in result.output


HELP_SCRIPT = """
import sys
from click.testing import CliRunner
from shardforge.cli.main import cli
for args in (["--help"], ["inference", "--help"], ["evaluate", "--help"]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
heavy = ("torch", "transformers", "peft", "shardforge.use.model", "shardforge.train")
print(sorted(m for m in sys.modules if m.startswith(heavy)))
"""


@pytest.mark.slow  # a fresh interpreter
def test_help_imports_no_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # python -m, and the runs trained under torchrun
def test_python_module_entry_point(runs: Runs) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardforge.cli.inference",
            str(runs.full_cfg),
            "--model_dir",
            str(runs.merged),
            "--max_new_tokens",
            "16",
            "--prompt",
            "The robot",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout
        == invoke(
            runs.full_cfg,
            "--model_dir",
            runs.merged,
            "--max_new_tokens",
            "16",
            "--prompt",
            "The robot",
        ).stdout
    )
    assert len(result.stdout.strip()) > 0 and "model:" in result.stderr
