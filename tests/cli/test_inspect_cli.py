"""`shardforge inspect` on the real checkpoints of `test_inspection` (3 gloo ranks, ours,
HF Trainer, Lightning, verl): JSON for scripts, the human report, --help, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import shardforge.cli.inspect as inspect_cli
from shardforge.cli.main import cli
from shardforge.errors import CheckpointError
from test_inspection import WORLD, Built, build_checkpoints


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["inspect", *(str(a) for a in args)])


def test_help_has_examples() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "Examples:" in result.output
    assert "shardforge inspect examples/tiny-llama.yml" in result.output
    for option in ("--step", "--json", "--all", "--debug"):
        assert option in result.output
    top = CliRunner().invoke(cli, ["--help"])
    assert "inspect" in top.output and "Describe a sharded checkpoint" in top.output


def test_json_parses_and_is_all_of_stdout(built: Built) -> None:
    result = run(built.ours, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["layout"], doc["step"], doc["world_size"]) == ("shardforge", 4, WORLD)
    assert doc["model"]["tensor_count"] == len(built.names)
    assert doc["model"]["parameter_count"] == built.params
    assert doc["model"]["total_bytes"] == built.nbytes
    assert [t["name"] for t in doc["model"]["tensors"]] == list(built.names)
    for layout, path in (("hf-trainer", "hf"), ("lightning", "lightning"), ("verl", "verl")):
        other = json.loads(run(built.root / path, "--json").stdout)
        assert other["layout"].startswith(layout) and other["world_size"] == WORLD
        assert other["model"]["parameter_count"] == built.params


def test_module_entry_point_json_and_step(built: Built) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardforge.cli.inspect", str(built.ours), "--json", "--step", "2"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["step"] == 2 and doc["model_dir"].endswith("checkpoint-2/model")


def test_config_argument_with_override(built: Built, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"base_model: {built.base}\noutput_dir: {tmp_path / 'nowhere'}\n"
        "datasets:\n  - path: data.jsonl\n    type: completion\n"
    )
    result = run(cfg, "--step", "2", "--output_dir", built.ours, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["source"], doc["step"]) == (str(cfg), 2)
    missing = run(cfg)
    assert missing.exit_code == 1
    lines = missing.stderr.strip().splitlines()
    assert lines == [
        f"error: {cfg}: output_dir {tmp_path / 'nowhere'} does not exist; train first, or give "
        "the checkpoint directory instead of the config"
    ]


def test_human_report_header_and_table(built: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(built.ours)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "layout       shardforge, step 4 (dcp)" in out
    assert "steps found  2, 4 (shardforge)" in out
    assert "world size   3 (from trainer_state.json)" in out
    assert f"{built.params:,} parameters" in out and f"{built.nbytes:,} bytes" in out
    assert f"optimizer    {3 * len(built.names)} tensors" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == [
        "name", "dtype", "shape", "params", "bytes"
    ])  # fmt: skip
    assert lines[header + 1].split() == [
        "model.embed_tokens.weight", "float32", "331", "x", "64", "21,184", "84,736"
    ]  # fmt: skip
    assert len(lines) - header - 1 == len(built.names)  # 21 tensors: all shown

    monkeypatch.setattr(inspect_cli, "TABLE_ENDS", 3)
    short = run(built.ours).stdout
    hidden = len(built.names) - 6
    assert f"... {hidden} more tensors (--all shows every tensor) ..." in short
    assert "model.layers.0.mlp.gate_proj.weight" not in short
    assert "lm_head.weight" in short  # the last ones are shown
    full = run(built.ours, "--all").stdout
    assert all(name in full for name in built.names) and "more tensors" not in full


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "checkpoint path does not exist"),
        (lambda tmp: tmp, "directory is empty"),
        (lambda tmp: _file(tmp / "cfg.txt"), "not a directory; give a checkpoint directory"),
        (lambda tmp: _file(tmp / "notes" / "x.txt").parent, "no complete checkpoint found"),
    ],
)
def test_bad_paths_get_one_line_errors(tmp_path: Path, make: object, message: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    for extra in ((), ("--json",)):
        result = run(path, *extra)
        assert result.exit_code == 1
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()  # one error line, then indented details
        assert lines[0].startswith(f"error: {path}: ")
        assert all(line.startswith("  ") for line in lines[1:])
        assert message in lines[0] and "Traceback" not in result.stderr
    debug = run(path, "--debug")
    assert isinstance(debug.exception, CheckpointError) and message in str(debug.exception)


def test_optimizer_directory_points_to_the_model(built: Built) -> None:
    opt = built.root / "hf" / "checkpoint-7" / "optimizer_0"
    result = run(opt)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip() == (
        f"error: {opt}: this is an optimizer checkpoint, not model weights; the model weights "
        f"are in {opt.parent / 'pytorch_model_fsdp_0'}"
    )


def test_unknown_step_lists_the_steps(built: Built) -> None:
    result = run(built.ours, "--step", "3")
    assert result.exit_code == 1
    assert "no complete checkpoint for step 3; steps found: [2, 4]" in result.stderr


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not a checkpoint\n")
    return path


@pytest.mark.slow  # the checkpoints are written by gloo ranks
def test_an_axolotl_config_with_values_only_training_reads(built: Built, tmp_path: Path) -> None:
    """inspect reads base_model and output_dir only: an unknown chat template name, an
    optimizer or a LoRA value shardforge does not have change nothing."""
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(
        f"base_model: {built.base}\noutput_dir: {built.ours}\nchat_template: gemma9\n"
        "optimizer: adamw_anyprecision\nadapter: lora\nlora_r: sixteen\ndebug: true\n"
    )
    result = run(cfg, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 4


@pytest.fixture(scope="module")
def keep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint with an FP8 weight, an int buffer and a `_keep_in_fp32_modules`
    module (helpers.keep), and a config naming its base model."""
    from helpers.keep import make_keep_checkpoint

    root = tmp_path_factory.mktemp("keep")
    base, ckpt = make_keep_checkpoint(root)
    (root / "cfg.yml").write_text(f"base_model: {base}\noutput_dir: {ckpt}\n")
    return root


def test_dtype_lists_what_is_cast_and_kept_and_why(keep_run: Path) -> None:
    from helpers.keep import FP8_WEIGHT, INT_BUFFER, KEPT

    result = run(keep_run / "cfg.yml", "--dtype", "bf16", "--keep_dtype", "norm")
    assert result.exit_code == 0, result.output
    rules = result.stdout.split("dtype rules (output dtype bfloat16):\n")[1].split("\n\n")[0]
    lines = rules.splitlines()
    assert lines[0].startswith("  cast float32 -> bfloat16: 15 tensors (model.embed_tokens")
    assert "  kept: --keep_dtype 'norm': 5 tensors (" in rules
    assert f"  kept: integer tensors are never cast: 1 tensor ({INT_BUFFER})" in lines
    assert f"'router': 1 tensor ({KEPT})" in rules  # the model class's own list
    assert f"1 tensor ({FP8_WEIGHT})" in rules and len(lines) == 5
    doc = json.loads(run(keep_run / "cfg.yml", "--dtype", "bf16", "--json").stdout)
    tensors = doc["dtype_rules"]["tensors"]
    assert len(tensors) == doc["model"]["tensor_count"] == 23
    assert tensors[KEPT] == {
        "saved": "float32",
        "dtype": "float32",
        "rule": "kept: TinyKeepForCausalLM._keep_in_fp32_modules 'router'",
    }
    assert tensors["model.norm.weight"]["dtype"] == "bfloat16"  # no --keep_dtype this time
    assert tensors[FP8_WEIGHT]["dtype"] == "float8_e4m3fn"


def test_dtype_of_a_plain_path_and_bad_values(keep_run: Path) -> None:
    every = run(keep_run / "checkpoint", "--keep_dtype", "norm", "--all")
    assert "dtype rules (output dtype none (as saved; give --dtype)):" in every.stdout
    assert "  as saved (no output dtype): 23 tensors (" in every.stdout
    assert every.stdout.count("as saved (no output dtype)") == 24  # the rule, every tensor
    bad = run(keep_run / "checkpoint", "--dtype", "int8")
    assert bad.exit_code == 1 and bad.stderr.startswith("error: --dtype 'int8': expected one of")
    bad = run(keep_run / "checkpoint", "--dtype", "bf16", "--keep_dtype", "(")
    assert bad.stderr.splitlines()[0].startswith("error: --keep_dtype '(': not a pattern")
