"""`shardforge merge-sharded-fsdp-weights`: bad inputs each give a one-line error, a non-zero
exit, no output directory and unchanged input bytes; plus the CLI's spellings and --help."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from helpers.tiny import make_model
from shardforge.cli.main import cli
from shardforge.errors import CheckpointError

CMD = "merge-sharded-fsdp-weights"


def _save_run(base: Path, run: Path) -> None:
    """A real single-process DCP save in shardforge's layout (model + optimizer) and the
    HF Trainer layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    ckpt = run / "checkpoint-1"
    dcp.save(model.state_dict(), checkpoint_id=ckpt / "model", no_dist=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(model, opt)
    dcp.save(osd, checkpoint_id=ckpt / "optimizer", no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"format": "shardforge", "step": 1}))
    hf = run / "hf" / "checkpoint-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=hf / "pytorch_model_fsdp_0", no_dist=True)
    dcp.save({"optimizer": osd}, checkpoint_id=hf / "optimizer_0", no_dist=True)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    base = make_model(root / "base", "llama", vocab_size=320)
    make_model(root / "other", "llama", vocab_size=320, hidden_size=32, num_attention_heads=2)
    _save_run(base, root / "run")
    return root


@pytest.fixture
def env(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the run (so a test may corrupt it) and a config pointing at it."""
    shutil.copytree(pristine / "run", tmp_path / "run")
    cfg = {"base_model": str(pristine / "base"), "output_dir": str(tmp_path / "run")}
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(cfg))
    return tmp_path


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def invoke(env: Path, *args: str) -> Any:
    return CliRunner().invoke(cli, [CMD, str(env / "cfg.yml"), "--quiet", *args])


def one_line_error(stderr: str) -> str:
    """The error is one `error:` line (at most 300 characters), the last one but for the
    indented details under it (at most 20 and "(+N more)"); no traceback. (Lines before it are
    progress information, such as the chosen checkpoint.) Returns the error and its details."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert sum(line.startswith("error") for line in lines) == 1, stderr
    at = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    details = lines[at + 1 :]
    assert all(d.startswith("  ") for d in details) and len(details) <= 21, stderr
    assert len(lines[at]) <= 300, lines[at]
    assert "Traceback" not in stderr
    return "\n".join(lines[at:])


def assert_refused(env: Path, result: Any, before: str, *words: str) -> None:
    """Non-zero exit; `error: ...` on one line naming `words`; no output; input unchanged."""
    assert result.exit_code != 0, result.output
    error = one_line_error(result.stderr)
    for w in words:
        assert w in error, (w, error)
    assert not (env / "out").exists()
    assert not list(env.glob(".out.*"))  # no temp sibling left behind
    assert tree_hash(env / "run") == before


def _model_dir(env: Path) -> Path:
    return env / "run" / "checkpoint-1" / "model"


def test_merges_and_prints_the_output(env: Path) -> None:
    result = invoke(env, "--output-path", str(env / "out"), "--verify")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(env / "out")
    assert "checkpoint-1/model" in result.stderr  # the chosen checkpoint is printed
    assert (env / "out" / "model.safetensors").is_file()
    assert (env / "out" / "tokenizer.json").is_file()


def test_without_output_path_it_writes_output_dir_merged_as_axolotl(env: Path) -> None:
    result = invoke(env)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(env / "run" / "merged")
    assert "the default, as Axolotl" in result.stderr
    assert (env / "run" / "merged" / "model.safetensors").is_file()
    # a second merge to the same default asks for --overwrite, naming the folder
    again = invoke(env)
    assert again.exit_code != 0 and str(env / "run" / "merged") in again.stderr


def test_config_overrides_after_the_config(env: Path, pristine: Path) -> None:
    result = invoke(env, "--output_path", str(env / "out"), "--base_model", str(pristine / "other"))
    assert result.exit_code != 0  # the override took effect: the architecture does not match
    assert "does not match the architecture" in result.stderr


def test_help_shows_examples() -> None:
    result = CliRunner().invoke(cli, [CMD, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output
    for option in ("--output_path", "--checkpoint", "--step", "--dtype", "--verify"):
        assert option in result.output
    assert "pytorch_model_fsdp_0" in result.output and "last.ckpt" in result.output


def test_help_names_object_storage_and_torchruns_options() -> None:
    from shardforge.merge.launch import torchrun_command
    from shardforge.merge.request import MergeRequest

    result = CliRunner().invoke(cli, [CMD, "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for words in (
        "s3://",
        "storage_options",
        "AWS_ACCESS_KEY_ID",
        "--rdzv_backend",
        "--max_restarts",
    ):
        assert words in text, words
    request = MergeRequest(output_path=Path("out"), nproc_per_node=2, rdzv_backend="static",
                           max_restarts=3)  # fmt: skip
    cmd = torchrun_command(request, Path("request.json"))
    assert cmd[cmd.index("--rdzv_backend") + 1] == "static"
    assert cmd[cmd.index("--max_restarts") + 1] == "3"


def test_missing_metadata(env: Path) -> None:
    (_model_dir(env) / ".metadata").unlink()
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(_model_dir(env)))
    assert_refused(env, result, before, "no .metadata")
    # searched from output_dir: the checkpoint is no longer complete
    assert_refused(env, invoke(env, "--output_path", str(env / "out")), before, "no complete")


def test_truncated_shard(env: Path) -> None:
    shard = _model_dir(env) / "__0_0.distcp"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"))
    assert_refused(env, result, before, "truncated", "__0_0.distcp")


class _Payload:
    def __init__(self, fn: Callable[..., Any], arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, (self.arg,))


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval"])
def test_metadata_pickle_with_code_execution_payload(env: Path, kind: str) -> None:
    marker = env / "pwned"
    meta_path = _model_dir(env) / ".metadata"
    with meta_path.open("rb") as f:
        meta = pickle.load(f)  # our own test file
    if kind == "os.system":
        payload = _Payload(os.system, f"touch {marker}")
    else:
        payload = _Payload(eval, f"open({str(marker)!r}, 'w').close()")
    meta.planner_data["evil"] = payload  # inside an otherwise valid metadata object
    meta_path.write_bytes(pickle.dumps(meta, protocol=4))
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"))
    assert_refused(env, result, before, "refused", ".metadata")
    assert not marker.exists()  # the payload did not run


def test_storage_path_escaping_the_directory(env: Path) -> None:
    meta_path = _model_dir(env) / ".metadata"
    with meta_path.open("rb") as f:
        meta = pickle.load(f)
    outside = env / "outside.distcp"
    shutil.copy(_model_dir(env) / "__0_0.distcp", outside)  # readable, but outside
    index = next(iter(meta.storage_data))
    info = meta.storage_data[index]
    info.relative_path = "../../../outside.distcp"
    meta_path.write_bytes(pickle.dumps(meta, protocol=4))
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"))
    assert_refused(env, result, before, "leaves the checkpoint directory")


def test_architecture_mismatch(env: Path, pristine: Path) -> None:
    cfg = yaml.safe_load((env / "cfg.yml").read_text())
    cfg["base_model"] = str(pristine / "other")
    (env / "cfg.yml").write_text(yaml.safe_dump(cfg))
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"))
    assert_refused(env, result, before, "shape mismatches", "model.embed_tokens.weight")


def _training_run(out: Path) -> None:
    """A folder as training leaves it: two checkpoints with optimizer state, metrics, notes."""
    for step in (10, 20):
        ck = out / f"checkpoint-{step}"
        (ck / "pytorch_model_fsdp_0").mkdir(parents=True)
        (ck / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(os.urandom(256))
        (ck / "optimizer_0").mkdir()
        (ck / "optimizer_0" / "__0_0.distcp").write_bytes(os.urandom(256))
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / "metrics.jsonl").write_text('{"loss": 1.5}\n')
    (out / "notes.md").write_text("mine: what I tried")
    (out / "config.json").write_text("{}")  # a model's file among them does not make it one


def test_existing_output(env: Path) -> None:
    out = env / "out"
    _training_run(out)
    before, run = tree_hash(out), tree_hash(env / "run")
    result = invoke(env, "--output_path", str(out))
    assert result.exit_code != 0
    assert "--overwrite" in one_line_error(result.stderr)
    # --overwrite replaces a model only: a training run's folder is refused, naming what it holds
    result = invoke(env, "--output_path", str(out), "--overwrite")
    assert result.exit_code != 0
    error = one_line_error(result.stderr)
    line = error.splitlines()[0]
    assert "holds more than a model" in line and "--overwrite_non_model" in line, error
    assert "checkpoint-10/, checkpoint-20/, metrics.jsonl, ... (4 entries)" in line, error
    assert "not written by a merge: notes.md" in error
    assert tree_hash(out) == before and tree_hash(env / "run") == run
    assert sorted(p.name for p in env.iterdir()) == ["cfg.yml", "out", "run"]  # no temporary
    result = invoke(env, "--output_path", str(out), "--overwrite_non_model")
    assert "--overwrite_non_model goes with --overwrite" in one_line_error(result.stderr)
    assert tree_hash(out) == before
    # the explicit option replaces all of it, only after success
    result = invoke(env, "--output_path", str(out), "--overwrite", "--overwrite_non_model")
    assert result.exit_code == 0, result.output
    assert not (out / "notes.md").exists() and not (out / "checkpoint-10").exists()
    assert (out / "model.safetensors").is_file()
    merged = tree_hash(out)
    # a folder that holds a previous model (a stale shard of it too) is replaced by --overwrite
    (out / "model-00001-of-00002.safetensors").write_bytes(b"a previous merge's shard")
    (out / "model.safetensors").write_bytes(b"a previous merge's weights")
    result = invoke(env, "--output_path", str(out), "--overwrite")
    assert result.exit_code == 0, result.output
    assert tree_hash(out) == merged
    assert tree_hash(env / "run") == run


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_output_path_under_a_symlink_loop_is_one_line(env: Path, fmt: str) -> None:
    """Directory links that point at each other: one error line before the merge runs (not
    `RuntimeError: Symlink loop` after it), nothing written, the run unchanged."""
    (env / "a").symlink_to(env / "b")
    (env / "b").symlink_to(env / "a")
    before = tree_hash(env / "run")
    out = env / "a" / ("merged" if fmt == "hf" else "model.safetensors")
    result = invoke(env, "--output_path", str(out), "--format", fmt)
    assert result.exit_code == 1, result.output
    assert one_line_error(result.stderr) == (
        f"error: {out}: the output path cannot be resolved (a loop of symbolic links); "
        "choose another output path"
    )
    assert "checkpoint:" not in result.stderr  # refused before the checkpoint was looked for
    assert tree_hash(env / "run") == before
    assert sorted(p.name for p in env.iterdir()) == ["a", "b", "cfg.yml", "run"]


def test_output_inside_the_checkpoint_is_refused(env: Path) -> None:
    before = tree_hash(env / "run")
    inside = _model_dir(env) / "merged"
    result = invoke(env, "--output_path", str(inside), "--overwrite")
    assert result.exit_code != 0
    assert "overlaps the checkpoint" in one_line_error(result.stderr)
    assert tree_hash(env / "run") == before
    # beside the checkpoints, inside output_dir, is fine
    result = invoke(env, "--output_path", str(env / "run" / "merged"))
    assert result.exit_code == 0, result.output


def test_empty_directory(env: Path) -> None:
    (env / "empty").mkdir()
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(env / "empty"))
    assert_refused(env, result, before, "empty")


def test_output_dir_without_checkpoints(env: Path) -> None:
    shutil.rmtree(env / "run" / "checkpoint-1")
    shutil.rmtree(env / "run" / "hf")
    (env / "run" / "notes.txt").write_text("x")
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"))
    assert_refused(env, result, before, "no complete checkpoint", "pytorch_model_fsdp_0")


@pytest.mark.parametrize(
    ("optimizer", "model"),
    [
        ("checkpoint-1/optimizer", "checkpoint-1/model"),
        ("hf/checkpoint-1/optimizer_0", "hf/checkpoint-1/pytorch_model_fsdp_0"),
    ],
)
def test_optimizer_directory_given(env: Path, optimizer: str, model: str) -> None:
    before = tree_hash(env / "run")
    result = invoke(
        env, "--output_path", str(env / "out"), "--checkpoint", str(env / "run" / optimizer)
    )
    assert_refused(env, result, before, "optimizer", str(env / "run" / model))


def test_optimizer_state_detected_by_keys(env: Path) -> None:
    renamed = env / "run" / "checkpoint-1" / "opt_state"
    (env / "run" / "checkpoint-1" / "optimizer").rename(renamed)
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(renamed))
    assert_refused(env, result, before, "only optimizer state")


def test_failure_late_in_the_merge_leaves_nothing(env: Path) -> None:
    """The weights are written, then the tokenizer fails: no output, no temp directory."""
    before = tree_hash(env / "run")
    result = invoke(
        env, "--output_path", str(env / "out"), "--tokenizer_config", str(env / "no-tokenizer")
    )
    assert_refused(env, result, before, "tokenizer")


def test_step_not_found(env: Path) -> None:
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), "--step", "7")
    assert_refused(env, result, before, "step 7", "[1]")


def _real_cli(env: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardforge", CMD, str(env / "cfg.yml"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_real_cli_refusals_in_a_subprocess(env: Path) -> None:
    marker = env / "pwned"
    meta_path = _model_dir(env) / ".metadata"
    with meta_path.open("rb") as f:
        meta = pickle.load(f)
    meta.planner_data["evil"] = _Payload(os.system, f"touch {marker}")
    meta_path.write_bytes(pickle.dumps(meta, protocol=4))
    (env / "out").mkdir()
    (env / "out" / "x").write_text("x")
    before = tree_hash(env / "run")
    for args, words in [
        (["--output_path", str(env / "out")], "--overwrite"),  # existing output
        (["--output_path", str(env / "new")], "refused"),  # malicious pickle
        (["--output_path", str(env / "new"), "--checkpoint", str(env / "nope")], "not exist"),
    ]:
        proc = _real_cli(env, *args)
        assert proc.returncode == 1, proc.stderr
        assert words in one_line_error(proc.stderr), proc.stderr
    assert not marker.exists()
    assert not (env / "new").exists()
    assert tree_hash(env / "run") == before


@pytest.mark.slow  # the real command in a process of its own
def test_quiet_keeps_transformers_bars_and_warnings_off_stderr(env: Path) -> None:
    """--quiet with --engine transformers (whose save_pretrained draws a bar, and DCP's loader
    warns): stderr holds shardforge's own lines only."""
    proc = _real_cli(env, "--output_path", str(env / "out"), "--engine", "transformers", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (env / "out" / "model.safetensors").is_file()
    for noise in ("Writing model shards", "it/s]", "Warning", "warnings.warn"):
        assert noise not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"wrote {env / 'out'} ")


@pytest.fixture(scope="module")
def module_merge(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One real `python -m shardforge.cli.merge_sharded_fsdp_weights` merge (bf16), run with
    `-X importtime`, so that its stderr lists every module the process imported: the module
    entry point and the imports of a merge are checked on the one launch."""
    root = tmp_path_factory.mktemp("module-merge")
    shutil.copytree(pristine / "run", root / "run")
    cfg = {"base_model": str(pristine / "base"), "output_dir": str(root / "run")}
    (root / "cfg.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "shardforge.cli.merge_sharded_fsdp_weights",
            str(root / "cfg.yml"),
            "--output_path",
            str(root / "out"),
            "--dtype",
            "bfloat16",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return root, proc


@pytest.mark.slow  # the real module entry point in a process of its own
def test_python_module_entry_point(module_merge: tuple[Path, Any]) -> None:
    root, proc = module_merge
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(root / "out" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


@pytest.mark.slow  # a fresh process: what the merge imports is all it has imported
def test_the_merge_does_not_import_training_code(module_merge: tuple[Path, Any]) -> None:
    root, proc = module_merge
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "out" / "model.safetensors").is_file()
    imported = [
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    ]
    assert "shardforge.merge.api" in imported  # the listing holds the merge's own imports
    assert not [m for m in imported if m.startswith("shardforge.train")], imported


# --- per-rank DTensor files (verl / LMMs-Engine), options of issue 6 ---


def _rank_run(env: Path, pristine: Path, world_size: int = 2) -> Path:
    """LMMs-Engine's layout in output_dir: checkpoint-3/pytorch_model_fsdp_0/ holding one
    torch.save'd state dict per rank (plain tensors here: every rank holds the full tensor)."""
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(pristine / "base").state_dict()
    folder = env / "ranks" / "checkpoint-3" / "pytorch_model_fsdp_0"
    folder.mkdir(parents=True)
    for rank in range(world_size):
        torch.save(sd, folder / f"model_world_size_{world_size}_rank_{rank}.pt")
    return folder


def test_rank_files_merge(env: Path, pristine: Path) -> None:
    _rank_run(env, pristine)
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(env / "ranks"))
    assert result.exit_code == 0, result.output
    assert "lmms-engine layout, rank-files" in result.stderr
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(pristine / "base").state_dict()
    for k, v in load_file(env / "out" / "model.safetensors").items():
        assert torch.equal(v, ref[k]), k


def _refused_rank_run(env: Path, result: Any, before: str, *words: str) -> None:
    assert result.exit_code != 0, result.output
    error = one_line_error(result.stderr)
    for w in words:
        assert w in error, (w, error)
    assert not (env / "out").exists() and not list(env.glob(".out.*"))
    assert tree_hash(env / "ranks") == before


def test_rank_file_missing(env: Path, pristine: Path) -> None:
    folder = _rank_run(env, pristine)
    (folder / "model_world_size_2_rank_1.pt").unlink()
    before = tree_hash(env / "ranks")
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(folder))
    _refused_rank_run(env, result, before, "missing", "model_world_size_2_rank_1.pt")


def test_rank_files_of_mismatched_world_sizes(env: Path, pristine: Path) -> None:
    folder = _rank_run(env, pristine)
    shutil.copy(folder / "model_world_size_2_rank_0.pt", folder / "model_world_size_3_rank_0.pt")
    before = tree_hash(env / "ranks")
    result = invoke(env, "--output_path", str(env / "out"), "--checkpoint", str(env / "ranks"))
    _refused_rank_run(env, result, before, "different world sizes", "2, 3")


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_rank_file_with_code_execution_payload(env: Path, pristine: Path, fmt: str) -> None:
    folder = _rank_run(env, pristine, world_size=1)
    marker = env / "pwned"
    evil = {"model.norm.weight": _Payload(os.system, f"touch {marker}")}
    torch.save(evil, folder / "model_world_size_1_rank_0.pt")
    before = tree_hash(env / "ranks")
    result = invoke(
        env, "--output_path", str(env / "out"), "--checkpoint", str(folder), "--format", fmt
    )
    _refused_rank_run(env, result, before, "refused", "model_world_size_1_rank_0.pt")
    assert not marker.exists()  # the payload did not run


def test_dry_run_prints_the_plan_and_writes_nothing(env: Path) -> None:
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "dry run: nothing is written" in result.stdout
    assert "model.safetensors:" in result.stdout and "free disk at" in result.stdout
    assert str(env / "out") in result.stdout
    assert not (env / "out").exists() and not list(env.glob(".out.*"))
    assert tree_hash(env / "run") == before


def test_dry_run_lists_what_remove_checkpoint_dir_would_delete(env: Path) -> None:
    before = tree_hash(env / "run")
    out = ["--output_path", str(env / "out")]
    result = invoke(env, *out, "--dry_run", "--remove_checkpoint_dir")
    assert result.exit_code == 0, result.output
    listing = result.stdout.split("--remove_checkpoint_dir: after verification, would remove ")[1]
    named = [line.strip() for line in listing.splitlines()[1:]]
    assert ".metadata" in named and any(n.endswith(".distcp") for n in named), listing
    assert not any("optim" in n or "trainer_state" in n for n in named), listing
    assert tree_hash(env / "run") == before


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--average_steps", "1,x"], "--average_steps"),
        (["--state-dict-dirname", "../x"], "inside the checkpoint"),
        (["--format", "safetensors"], "--output_path is required"),
        (["--average-last", "2"], "has only 1"),
        (["--average-last", "2", "--average_steps", "1,2"], "not both"),
        (["--average_steps", "1,1"], "listed twice"),
        (["--step", "1", "--average_steps", "1,2"], "--step picks one checkpoint"),
        (["--engine", "transformers", "--format", "torch"], "--engine transformers"),
        (["--format", "torch", "--max_shard_size", "1GB"], "--max_shard_size"),
        (["--average_last", "2", "--remove_checkpoint_dir"], "--remove_checkpoint_dir"),
    ],
)
def test_bad_new_options(env: Path, args: list[str], words: str) -> None:
    before = tree_hash(env / "run")
    out = [] if "--format" in args else ["--output_path", str(env / "out")]
    result = invoke(env, *out, *args)
    assert_refused(env, result, before, words)


def test_help_shows_the_new_options() -> None:
    result = CliRunner().invoke(cli, [CMD, "--help"])
    assert result.exit_code == 0
    for option in (
        "--state_dict_dirname",
        "--average_last",
        "--average_steps",
        "--format",
        "--dry_run",
        "pytorch_ema_model_fsdp_0",
        "model_world_size_W_rank_R.pt",
    ):
        assert option in result.output, option


def test_single_file_formats_refuse_existing_outputs(env: Path) -> None:
    before = tree_hash(env / "run")
    target = env / "m.safetensors"
    target.write_bytes(b"keep me")
    result = invoke(env, "--format", "safetensors", "--output_path", str(target))
    assert result.exit_code != 0 and "--overwrite" in one_line_error(result.stderr)
    assert target.read_bytes() == b"keep me"
    (env / "adir").mkdir()
    result = invoke(env, "--format", "torch", "--output_path", str(env / "adir"))
    assert result.exit_code != 0 and "is a directory" in one_line_error(result.stderr)
    result = invoke(env, "--format", "safetensors", "--output_path", str(target), "--overwrite")
    assert result.exit_code == 0, result.output
    assert target.read_bytes() != b"keep me"
    assert sorted(p.name for p in env.iterdir()) == ["adir", "cfg.yml", "m.safetensors", "run"]
    assert tree_hash(env / "run") == before


@pytest.mark.parametrize(
    ("typo", "meant"), [("--verfy", "--verify"), ("--outputpath", "--output_path")]
)
def test_a_mistyped_option_is_an_option_error(env: Path, typo: str, meant: str) -> None:
    before = tree_hash(env / "run")
    result = invoke(env, "--output_path", str(env / "out"), typo)
    assert result.exit_code == 2
    error = one_line_error(result.stderr)
    assert f"no such option {typo}; did you mean {meant}?" in error
    assert "config key" not in error and "output_dir" not in error
    assert not (env / "out").exists()
    assert tree_hash(env / "run") == before


AXOLOTL_EXTRAS = {
    # a full Axolotl training config: none of this concerns the merge
    "adapter": "qlora",  # the merge reads a LoRA run's keys only with adapter: lora
    "chat_template": "chatml",  # a name: the merged tokenizer gets the template text
    "lora_r": 16,
    "load_in_4bit": True,
    "plugins": ["axolotl.integrations.liger.LigerPlugin"],
    "liger_rms_norm": True,
    "rl": "dpo",  # features train does not have (left for later: issue 34)
    "lisa_n_layers": 4,
    "val_set_size": 0.05,
    "wandb_project": None,
    "special_tokens": None,
    "dataset_prepared_path": "last_run_prepared",
    "lr_scheduler": "reduce_lr_on_plateau",
    "optimizer": "adamw_anyprecision",
    "datasets": [{"path": "tatsu-lab/alpaca", "type": "alpaca:chatml", "name": "x"}],
    "fsdp": ["full_shard", "auto_wrap"],
    "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_use_orig_params": False},
}


def test_any_axolotl_config_drives_the_merge(env: Path, pristine: Path) -> None:
    cfg = yaml.safe_load((env / "cfg.yml").read_text()) | AXOLOTL_EXTRAS
    (env / "cfg.yml").write_text(yaml.safe_dump(cfg))
    result = invoke(env, "--output_path", str(env / "out"))
    assert result.exit_code == 0, result.output
    assert (env / "out" / "model.safetensors").is_file()
    # the keys a merge leaves unread are what any config has: no line about them (validate says)
    assert "not used by this command" not in result.stderr, result.stderr
    saved = json.loads((env / "out" / "tokenizer_config.json").read_text())
    template = saved.get("chat_template") or (env / "out" / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template and template != "chatml"
    # the same config is refused by train's validation, one line per unsupported feature
    from shardforge.cli.validate import command as validate

    checked = CliRunner().invoke(validate, [str(env / "cfg.yml"), "--for", "train"])
    assert checked.exit_code == 2
    for key in ("rl", "lisa_n_layers"):
        assert f"  - {key}: " in checked.output and "not supported" in checked.output
    assert "wandb_project" not in checked.output  # a null placeholder is fine
    merge_ok = CliRunner().invoke(validate, [str(env / "cfg.yml"), "--for", "merge"])
    assert merge_ok.exit_code == 0, merge_ok.output
    assert "merge uses 6 of the config's 19 top-level keys" in merge_ok.stderr
    # the Python API takes the same config by path
    from safetensors.torch import load_file

    from shardforge import merge_fsdp_weights

    merge_fsdp_weights(str(env / "cfg.yml"), env / "out2", quiet=True)
    first, second = (load_file(str(env / d / "model.safetensors")) for d in ("out", "out2"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


# --- Axolotl's import path and arguments (issue 21) ---


def test_axolotl_merge_fsdp_weights_both_ways(env: Path, pristine: Path) -> None:
    """`merge_fsdp_weights(cfg, output_path=..., save_tokenizer=...)` with load_cfg's DictDefault
    (a value only training reads does not stop it), and Axolotl 0.21's
    `merge_fsdp_weights(checkpoint_dir, output_path)`, the run's config.json beside it."""
    from transformers import AutoModelForCausalLM

    from shardforge.cli.config import load_cfg
    from shardforge.cli.merge_sharded_fsdp_weights import merge_fsdp_weights

    want = AutoModelForCausalLM.from_pretrained(pristine / "base").state_dict()

    def same(out: Path) -> bool:
        from safetensors.torch import load_file

        got = load_file(out / "model.safetensors")
        return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    cfg = load_cfg(env / "cfg.yml", optimizer="adamw_anyprecision", chat_template="gemma9")
    out = merge_fsdp_weights(cfg, output_path=env / "out", save_tokenizer=False, quiet=True)
    assert out == env / "out" and same(out) and not (out / "tokenizer.json").exists()
    checkpoint = env / "run" / "hf" / "checkpoint-1" / "pytorch_model_fsdp_0"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # Axolotl saves them
        shutil.copy(pristine / "base" / name, env / "run" / "hf" / name)  # in output_dir
    assert same(merge_fsdp_weights(checkpoint_dir=checkpoint, output_path=env / "o2", quiet=True))
    assert same(merge_fsdp_weights(str(checkpoint), str(env / "o3"), quiet=True))
    (env / "run" / "hf" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json in it or the folders above it"):
        merge_fsdp_weights(checkpoint_dir=checkpoint, output_path=env / "o4")
    with pytest.raises(TypeError, match="needs the run's config"):
        merge_fsdp_weights(output_path=env / "o5")


def test_the_merge_reads_only_its_keys(env: Path) -> None:
    """Values of keys the merge does not read (training's, a LoRA run's when adapter is not
    lora) never fail it; a template name it cannot render is one notice."""
    cfg = yaml.safe_load((env / "cfg.yml").read_text())
    cfg.update(
        optimizer="adamw_anyprecision",
        lr_scheduler="reduce_lr_on_plateau",
        chat_template="gemma9",
        lora_r="sixteen",
        fsdp_config={"fsdp_sharding_strategy": "NO_SHARD"},
    )
    (env / "cfg.yml").write_text(yaml.safe_dump(cfg))
    result = invoke(env, "--output_path", str(env / "out"))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("unknown template name 'gemma9'") == 1
    refused = CliRunner().invoke(cli, ["validate", str(env / "cfg.yml")])
    assert refused.exit_code == 2 and "lora_r" in refused.stderr  # train reads them all
