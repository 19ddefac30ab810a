"""accelerate's per-rank `.bin` files (`formats.accelerate_bin`), written by accelerate's own
``save_fsdp_model(..., use_dcp=False)`` on 2 gloo ranks of a fully_shard-ed tiny Llama
(`helpers.shared.saved_formats`): the merge is bit-exact and transformers computes the trained
model's logits from it; the adapter_only save merges to the PEFT adapter; `inspect`, `--verify`,
`--remove_checkpoint_dir` and `--all_steps` reach it through its rows; damaged, incomplete and
mixed folders are refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.shared import logits, merge_refused, merges_to_the_trained_model
from shardforge.inspection import inspect_checkpoint
from shardforge.merge.api import merge_fsdp_weights

pytestmark = pytest.mark.slow  # the checkpoints are written by 2 gloo ranks

MODEL_FILES = ("pytorch_model_fsdp_0_rank0.bin", "pytorch_model_fsdp_0_rank1.bin")


def _cfg(saved: Path, out: Path) -> dict[str, str]:
    return {"base_model": str(saved / "base"), "output_dir": str(out)}


def _copy(saved: Path, tmp_path: Path, name: str = "checkpoint_1") -> Path:
    """The accelerate checkpoint copied into a run folder of `tmp_path` (tests change it)."""
    return Path(shutil.copytree(saved / "accelerate" / "checkpoint_1", tmp_path / "run" / name))


def test_the_merge_is_bit_exact_and_gives_the_trained_logits(saved: Path, tmp_path: Path) -> None:
    checkpoint = saved / "accelerate" / "checkpoint_1"
    merges_to_the_trained_model(saved, checkpoint, tmp_path / "merged")


def test_an_adapter_only_save_merges_to_the_peft_adapter(saved: Path, tmp_path: Path) -> None:
    """save_fsdp_model(adapter_only=True) holds the adapter under the adapter file's names
    (get_peft_model_state_dict); the merge writes the adapter PEFT itself saved."""
    out = merge_fsdp_weights(
        _cfg(saved, tmp_path),
        tmp_path / "adapter",
        checkpoint=saved / "accelerate-lora" / "checkpoint_1",
        verify=True,
        quiet=True,
    )
    got = load_file(out / "adapter_model.safetensors")
    want = load_file(saved / "lora-expected" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and len(got) == 8
    assert all(torch.equal(got[k], want[k]) for k in want)
    base = saved / "base"
    assert torch.equal(logits(base, out), logits(base, saved / "lora-expected"))
    assert not torch.equal(logits(base, out), logits(base))


def test_inspect_finds_the_step_ranks_and_optimizer_files(saved: Path, tmp_path: Path) -> None:
    run = _copy(saved, tmp_path).parent
    _copy(saved, tmp_path, "checkpoint_3")
    facts = inspect_checkpoint(run)
    assert (facts.layout, facts.step, facts.contents.storage) == (
        "accelerate-per-rank",
        3,
        "accelerate-bin",
    )
    assert facts.contents.world_size == 2
    assert len(facts.tensors) == len(load_file(saved / "trained" / "model.safetensors"))
    optimizer = facts.contents.optimizer
    assert optimizer is not None and optimizer.files == 2
    assert sorted(s.step for s in facts.steps if s.step is not None) == [1, 3]
    direct = inspect_checkpoint(run / "checkpoint_1")
    assert (direct.layout, direct.step) == ("accelerate-per-rank", 1)


def test_all_steps_and_removal_keep_the_optimizer_files(saved: Path, tmp_path: Path) -> None:
    run = _copy(saved, tmp_path).parent
    _copy(saved, tmp_path, "checkpoint_3")
    out = merge_fsdp_weights(
        _cfg(saved, tmp_path), tmp_path / "merged", checkpoint=run, all_steps=True, quiet=True
    )
    assert sorted(p.name for p in out.iterdir()) == ["step-1", "step-3"]
    want = load_file(saved / "trained" / "model.safetensors")
    got = load_file(out / "step-3" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    merge_fsdp_weights(
        _cfg(saved, tmp_path),
        tmp_path / "removed",
        checkpoint=run / "checkpoint_3",
        verify=True,
        remove_checkpoint_dir=True,
        quiet=True,
    )
    left = sorted(p.name for p in (run / "checkpoint_3").iterdir())
    assert left == ["optimizer_0_rank0.bin", "optimizer_0_rank1.bin"]
    assert all((run / "checkpoint_1" / f).is_file() for f in MODEL_FILES)


def test_damaged_incomplete_and_mixed_folders_are_refused(saved: Path, tmp_path: Path) -> None:
    base, ckpt = saved / "base", _copy(saved, tmp_path)
    rank1 = ckpt / MODEL_FILES[1]
    data = rank1.read_bytes()
    rank1.write_bytes(data[: len(data) // 2])  # cut off while copying
    assert str(rank1) in merge_refused(base, ckpt, tmp_path / "a")
    rank1.unlink()  # a missing last rank: the names cannot tell, the device mesh does
    assert "lies on 2 ranks" in merge_refused(base, ckpt, tmp_path / "b")
    rank1.write_bytes(data)
    (ckpt / "pytorch_model_fsdp_0_rank3.bin").write_bytes(data)  # a gap: rank 2 is missing
    assert "pytorch_model_fsdp_0_rank2.bin" in merge_refused(base, ckpt, tmp_path / "c")
    (ckpt / "pytorch_model_fsdp_0_rank3.bin").unlink()
    other = saved / "accelerate-lora" / "checkpoint_1" / MODEL_FILES[1]
    shutil.copyfile(other, rank1)  # a rank of another save
    assert "keys differ" in merge_refused(base, ckpt, tmp_path / "d")
