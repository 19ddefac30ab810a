"""Step discovery (verl `global_step_N` + latest file, LMMs-Engine `checkpoint-N`) and the rank
folder inside a step, ending in a verl-layout round trip."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from rank_helpers import logits
from safetensors.torch import load_file

from shardforge.errors import CheckpointError
from shardforge.rankfiles import (
    find_latest_step,
    find_rank_dir,
    find_step,
    iter_tensors,
    list_steps,
    plan_rank_files,
)


def _dirs(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
    return root


def test_verl_latest_file_wins(tmp_path: Path) -> None:
    root = _dirs(tmp_path, "global_step_10", "global_step_20", "global_step_5", "other")
    (root / "latest_checkpointed_iteration.txt").write_text("10\n")
    step = find_latest_step(root)
    assert (step.number, step.path.name, step.trainer) == (10, "global_step_10", "verl")
    assert [s.number for s in list_steps(root)] == [5, 10, 20]
    (root / "latest_checkpointed_iteration.txt").unlink()
    assert find_latest_step(root).number == 20


def test_verl_latest_file_errors(tmp_path: Path) -> None:
    root = _dirs(tmp_path, "global_step_1")
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointError, match=r"names step 7, but .* has no global_step_7 folder"):
        find_latest_step(root)
    (root / "latest_checkpointed_iteration.txt").write_text("seven")
    with pytest.raises(CheckpointError, match="expected a step number, got 'seven'"):
        find_latest_step(root)


def test_checkpoint_n_highest_and_explicit_step(tmp_path: Path) -> None:
    root = _dirs(tmp_path, "checkpoint-500", "checkpoint-1000", "checkpoint-50")
    assert find_latest_step(root).path.name == "checkpoint-1000"  # numeric, not lexical
    assert find_step(root, 50).path.name == "checkpoint-50"
    with pytest.raises(CheckpointError, match="no step 7; available: 50, 500, 1000"):
        find_step(root, 7)


def test_no_steps_and_mixed_trainers(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"no step folders \(expected global_step_N or checkpoint-N\)"
    ):
        find_latest_step(_dirs(tmp_path / "a", "logs"))
    with pytest.raises(CheckpointError, match="several trainers"):
        find_latest_step(_dirs(tmp_path / "b", "checkpoint-1", "global_step_2"))
    with pytest.raises(CheckpointError, match="not a directory"):
        find_latest_step(tmp_path / "missing")


def test_find_rank_dir(tmp_path: Path) -> None:
    step = _dirs(tmp_path / "checkpoint-3", "pytorch_model_fsdp_0", "pytorch_ema_model_fsdp_0")
    for sub in ("pytorch_model_fsdp_0", "pytorch_ema_model_fsdp_0"):
        (step / sub / "model_world_size_1_rank_0.pt").touch()
    assert find_rank_dir(step).name == "pytorch_model_fsdp_0"
    assert find_rank_dir(step, "pytorch_ema_model_fsdp_0").name == "pytorch_ema_model_fsdp_0"
    with pytest.raises(CheckpointError, match="must be a folder inside"):
        find_rank_dir(step, "../..")
    with pytest.raises(CheckpointError, match=r"no model_world_size_<W>_rank_<R>\.pt files in"):
        find_rank_dir(step, "optimizer_0")
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "model_world_size_2_rank_0.pt").touch()
    assert find_rank_dir(flat) == flat


def test_verl_layout_round_trip(ranks_2_fp32: tuple[Path, Path], tmp_path: Path) -> None:
    """global_step_N/actor/ rank files + huggingface/ config, latest from the latest file."""
    model_dir, rank_dir = ranks_2_fp32
    root = tmp_path / "verl"
    for n in (2, 4):
        actor = root / f"global_step_{n}" / "actor"
        shutil.copytree(rank_dir, actor)
        shutil.copytree(model_dir, actor / "huggingface", ignore=shutil.ignore_patterns("*.safe*"))
        (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 2}')
    (root / "global_step_2" / "actor" / "model_world_size_2_rank_1.pt").unlink()  # stale step
    (root / "latest_checkpointed_iteration.txt").write_text("4")

    step = find_latest_step(root)
    actor = find_rank_dir(step.path)
    assert actor == (root / "global_step_4" / "actor").resolve()
    merged = dict(iter_tensors(plan_rank_files(actor)))
    original = load_file(model_dir / "model.safetensors")
    assert merged.keys() == original.keys()
    assert all(torch.equal(merged[k], original[k]) for k in original)
    assert torch.equal(logits(model_dir, merged), logits(model_dir))
