"""DCP's safetensors storage, consolidated (`formats.dcp_safetensors.consolidated`):
``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)`` into a torchtitan
``step-N/`` (its ``last_save_in_hf``) on 2 gloo ranks (`helpers.shared.saved_formats`): the
shards in ``sharded/``, torch's consolidated file and index beside them. The merge is bit-exact
and gives the trained logits; `inspect`, `--all_steps` and `--remove_checkpoint_dir` find it as
torchtitan's step; consolidated files of another save are refused, and without them the shards
are merged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.shared import merge_refused, merges_to_the_trained_model
from shardforge.formats.dcp_safetensors.consolidated import ConsolidatedSource
from shardforge.formats.dcp_safetensors.sharded import ShardedSource
from shardforge.formats.registry import format_named
from shardforge.inspection import inspect_checkpoint
from shardforge.merge.api import merge_fsdp_weights

pytestmark = pytest.mark.slow  # the checkpoints are written by 2 gloo ranks

CONSOLIDATED = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


def _run(saved: Path, tmp_path: Path, *steps: int) -> Path:
    """A torchtitan run folder holding the saved step as each of `steps`."""
    for step in steps:
        shutil.copytree(saved / "titan" / "step-4", tmp_path / "titan" / f"step-{step}")
    return tmp_path / "titan"


def _merged(saved: Path, tmp_path: Path, checkpoint: Path, **options: object) -> Path:
    cfg = {"base_model": str(saved / "base"), "output_dir": str(tmp_path)}
    return merge_fsdp_weights(
        cfg, tmp_path / "merged", checkpoint=checkpoint, quiet=True, **options
    )


def _trained(saved: Path, out: Path) -> None:
    got = load_file(out / "model.safetensors")
    want = load_file(saved / "trained" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_consolidated_files_are_read_and_merge_bit_exact(saved: Path, tmp_path: Path) -> None:
    step = saved / "titan" / "step-4"
    named = format_named("dcp-safetensors").open(step)
    assert all(isinstance(n.source, ConsolidatedSource) for n in named.values())
    merges_to_the_trained_model(saved, step, tmp_path / "merged")


def test_inspect_all_steps_and_removal_as_torchtitan_steps(saved: Path, tmp_path: Path) -> None:
    run = _run(saved, tmp_path, 4, 8)
    facts = inspect_checkpoint(run)
    assert (facts.layout, facts.step, facts.key_names) == ("torchtitan-hf", 8, "hugging-face")
    assert facts.contents.storage == "dcp-safetensors" and facts.contents.world_size == 2
    out = _merged(saved, tmp_path, run, all_steps=True)
    assert sorted(p.name for p in out.iterdir()) == ["step-4", "step-8"]
    _trained(saved, out / "step-8")
    cfg = {"base_model": str(saved / "base"), "output_dir": str(tmp_path)}
    merge_fsdp_weights(
        cfg,
        tmp_path / "removed",
        checkpoint=run / "step-8",
        verify=True,
        remove_checkpoint_dir=True,
        quiet=True,
    )
    assert not (run / "step-8").exists() and (run / "step-4" / INDEX).is_file()


def test_without_the_consolidated_files_the_shards_are_merged(saved: Path, tmp_path: Path) -> None:
    """torch's consolidator stops before writing anything on an integer tensor: the step then
    holds only sharded/."""
    step = _run(saved, tmp_path, 4) / "step-4"
    (step / INDEX).unlink()
    (step / CONSOLIDATED).unlink()
    named = format_named("dcp-safetensors").open(step)
    assert all(isinstance(n.source, ShardedSource) for n in named.values())
    merges_to_the_trained_model(saved, step, tmp_path / "merged")


def test_consolidated_files_of_another_save_are_refused(saved: Path, tmp_path: Path) -> None:
    step = _run(saved, tmp_path, 4) / "step-4"
    other = saved / "contract" / "consolidated"
    shutil.copyfile(other / CONSOLIDATED, step / CONSOLIDATED)
    shutil.copyfile(other / INDEX, step / INDEX)
    assert "only in the" in merge_refused(saved / "base", step, tmp_path / "a")
    shutil.copyfile(saved / "titan" / "step-4" / CONSOLIDATED, step / CONSOLIDATED)
    index = json.loads((saved / "titan" / "step-4" / INDEX).read_text())
    index["weight_map"].pop("lm_head.weight")
    (step / INDEX).write_text(json.dumps(index))
    assert INDEX in merge_refused(saved / "base", step, tmp_path / "b")
