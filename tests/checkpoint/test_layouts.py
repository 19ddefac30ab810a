"""Finding the model DCP directory in each trainer's layout (directories built as they write
them; the marker files stand in for the DCP contents, which this stage does not read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.checkpoint.layouts import resolve_checkpoint
from shardforge.errors import CheckpointError


def dcp_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_bytes(b"")
    return path


def test_shardforge_latest_complete_and_step(tmp_path: Path) -> None:
    for step in (5, 10, 20):
        dcp_dir(tmp_path / f"checkpoint-{step}" / "model")
        if step != 20:  # checkpoint-20 has no trainer_state.json: incomplete
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    dcp_dir(tmp_path / "checkpoint-30.tmp-1" / "model")
    assert resolve_checkpoint(tmp_path).model_dir == tmp_path / "checkpoint-10" / "model"
    assert resolve_checkpoint(tmp_path, step=5).model_dir == tmp_path / "checkpoint-5" / "model"
    with pytest.raises(CheckpointError, match=r"step 20.*\[5, 10\]"):
        resolve_checkpoint(tmp_path, step=20)


def test_hf_trainer_and_accelerate(tmp_path: Path) -> None:
    for step in (9, 100, 11):
        dcp_dir(tmp_path / f"checkpoint-{step}" / "pytorch_model_fsdp_0")
        dcp_dir(tmp_path / f"checkpoint-{step}" / "optimizer_0")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step) == ("hf-trainer", 100)
    assert got.model_dir.name == "pytorch_model_fsdp_0"
    acc = tmp_path / "acc"
    dcp_dir(acc / "pytorch_model_fsdp_0")
    assert resolve_checkpoint(acc).model_dir == acc / "pytorch_model_fsdp_0"


def test_lightning_last_first_else_highest_step(tmp_path: Path) -> None:
    ckpts = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    for name in ("epoch=0-step=50.ckpt", "epoch=1-step=100.ckpt"):
        (dcp_dir(ckpts / name) / "meta.pt").write_bytes(b"")
    assert resolve_checkpoint(tmp_path).model_dir.name == "epoch=1-step=100.ckpt"
    assert resolve_checkpoint(tmp_path, step=50).model_dir.name == "epoch=0-step=50.ckpt"
    (dcp_dir(ckpts / "last.ckpt") / "meta.pt").write_bytes(b"")
    assert resolve_checkpoint(tmp_path).model_dir.name == "last.ckpt"
    # a .ckpt directory without meta.pt is not a Lightning checkpoint
    dcp_dir(ckpts / "epoch=2-step=999.ckpt")
    assert resolve_checkpoint(tmp_path).model_dir.name == "last.ckpt"


def test_a_dcp_directory_is_used_as_given(tmp_path: Path) -> None:
    d = dcp_dir(tmp_path / "anything")
    assert resolve_checkpoint(d).model_dir == d


@pytest.mark.parametrize(
    ("opt", "model"), [("optimizer", "model"), ("optimizer_0", "pytorch_model_fsdp_0")]
)
def test_optimizer_directory_points_to_the_model(tmp_path: Path, opt: str, model: str) -> None:
    dcp_dir(tmp_path / model)
    with pytest.raises(CheckpointError, match=f"optimizer.*{tmp_path / model}"):
        resolve_checkpoint(dcp_dir(tmp_path / opt))


def test_nothing_found_lists_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="looked for checkpoint-N/model/"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "e").mkdir()
    with pytest.raises(CheckpointError, match="empty"):
        resolve_checkpoint(tmp_path / "e")


def test_lightning_step_from_meta_pt_read_safely(tmp_path: Path) -> None:
    import os

    import torch

    ckpts = tmp_path / "checkpoints"
    torch.save({"global_step": 7, "epoch": 1}, dcp_dir(ckpts / "a.ckpt") / "meta.pt")
    torch.save({"global_step": 3}, dcp_dir(ckpts / "b.ckpt") / "meta.pt")
    assert resolve_checkpoint(tmp_path).model_dir.name == "a.ckpt"
    assert resolve_checkpoint(tmp_path, step=3).model_dir.name == "b.ckpt"

    class Payload:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {tmp_path / 'marker'}",))

    torch.save({"global_step": 99, "x": Payload()}, ckpts / "b.ckpt" / "meta.pt")
    assert resolve_checkpoint(tmp_path).model_dir.name == "a.ckpt"  # b's step is unknown now
    assert not (tmp_path / "marker").exists()


def test_a_full_model_directory_is_explained(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="full Hugging Face model already"):
        resolve_checkpoint(tmp_path)
