"""`--remove_checkpoint_dir` removes exactly the model shard files the merge read (and their
folder when nothing else is left in it), lists them, and never removes optimizer, trainer or RNG
state, configs, or anything it did not read. Where optimizer state lives in the same files
(torchtitan, Lightning, a model + optimizer DCP) it refuses before merging; a checkpoint reached
through a symbolic link is refused too.

The checkpoints are the real ones of `test_inspection` (3 gloo ranks after an AdamW step: ours,
HF Trainer, Lightning, torchtitan, verl, LMMs-Engine), copied so each test may remove shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from shardforge.cli.main import cli
from shardforge.errors import MergeError
from shardforge.layouts.catalog import resolve_checkpoint
from shardforge.merge.api import merge_fsdp_weights
from shardforge.merge.remove import plan_removal, remove_shards
from test_inspection import HF_STEP, LMMS_STEP, WORLD, Built, build_checkpoints

# the checkpoints are written by gloo ranks (build_checkpoints)
pytestmark = pytest.mark.slow

SHARED = "in the same files as the model weights; removing the shards would delete it"
DISTCP = [f"__{r}_0.distcp" for r in range(WORLD)]
RANK_FILES = [f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD)]


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (links not followed) -> its content hash, link target or 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def merge(
    built: Built, root: Path, out: Path, caplog: pytest.LogCaptureFixture, **kw: Any
) -> tuple[dict[str, str], dict[str, str]]:
    """Merge with --remove_checkpoint_dir; (tree before, tree after)."""
    before = snapshot(root.parent)
    cfg = {"base_model": str(built.base), "output_dir": str(root)}
    with caplog.at_level("INFO", logger="shardforge"):
        merge_fsdp_weights(cfg, out, remove_checkpoint_dir=True, quiet=True, **kw)
    assert (out / "model.safetensors").is_file()
    return before, snapshot(root.parent)


def assert_removed_exactly(
    before: dict[str, str], after: dict[str, str], removed: set[str], log: list[str], base: Path
) -> None:
    """Only `removed` went; everything else is byte for byte as it was; each removed file is
    listed in the log."""
    assert set(before) - set(after) == removed
    assert {k: v for k, v in before.items() if k not in removed} == after
    listed = {message.removeprefix(f"removed {base}/") for message in log}
    assert {rel for rel in removed if before[rel] != "dir"} <= listed


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_ours_removes_the_model_folder_and_keeps_optimizer_and_trainer_state(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = copy(built.ours, tmp_path / "w" / "run")
    before, after = merge(built, run, tmp_path / "out", caplog)
    model = "run/checkpoint-4/model"
    files = {f"{model}/.metadata", *(f"{model}/{n}" for n in DISTCP)}
    assert_removed_exactly(before, after, {*files, model}, caplog.messages, tmp_path / "w")
    assert "run/checkpoint-4/optimizer/.metadata" in after
    assert "run/checkpoint-4/trainer_state.json" in after
    assert any(k.startswith("run/checkpoint-4/rng_state_") for k in after)
    assert f"removed the empty folder {tmp_path / 'w' / model}" in caplog.text


def test_hf_trainer_keeps_what_it_did_not_read(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A notes file and a data file that `.metadata` does not name stay, so the folder does."""
    run = copy(built.root / "hf", tmp_path / "w" / "run")
    model = run / f"checkpoint-{HF_STEP}" / "pytorch_model_fsdp_0"
    (model / "notes.txt").write_text("mine")
    shutil.copy(model / DISTCP[0], model / "__9_0.distcp")  # not named by .metadata: not read
    before, after = merge(built, run, tmp_path / "out", caplog)
    rel = f"run/checkpoint-{HF_STEP}/pytorch_model_fsdp_0"
    files = {f"{rel}/.metadata", *(f"{rel}/{n}" for n in DISTCP)}
    assert_removed_exactly(before, after, files, caplog.messages, tmp_path / "w")
    assert f"kept {model}: it holds 2 other entries (__9_0.distcp, notes.txt)" in caplog.text
    assert f"run/checkpoint-{HF_STEP}/optimizer_0/.metadata" in after


def test_verl_removes_only_model_rank_files(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = copy(built.root / "verl", tmp_path / "w" / "run")
    actor = run / "global_step_3" / "actor"
    shutil.copytree(built.base, actor / "huggingface")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}))
    for r in range(WORLD):
        torch.save({"rng": torch.zeros(2)}, actor / f"extra_state_world_size_{WORLD}_rank_{r}.pt")
    before, after = merge(built, run, tmp_path / "out", caplog)
    rel = "run/global_step_3/actor"
    assert_removed_exactly(
        before, after, {f"{rel}/{n}" for n in RANK_FILES}, caplog.messages, tmp_path / "w"
    )
    assert f"{rel}/optim_world_size_{WORLD}_rank_0.pt" in after
    assert f"{rel}/huggingface/config.json" in after
    assert "run/global_step_1/actor" in after


def test_lmms_engine_rank_files_in_the_step_folder(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = built.root / "lmms" / f"checkpoint-{LMMS_STEP}"
    step = tmp_path / "w" / "run" / f"checkpoint-{LMMS_STEP}"
    step.mkdir(parents=True)
    for name in RANK_FILES:
        shutil.copy(src / "pytorch_model_fsdp_0" / name, step / name)
    copy(src / "pytorch_ema_model_fsdp_0", step / "pytorch_ema_model_fsdp_0")
    (step / "trainer_state.json").write_text("{}")
    before, after = merge(built, step.parent, tmp_path / "out", caplog)
    rel = f"run/checkpoint-{LMMS_STEP}"
    assert_removed_exactly(
        before, after, {f"{rel}/{n}" for n in RANK_FILES}, caplog.messages, tmp_path / "w"
    )
    assert f"{rel}/pytorch_ema_model_fsdp_0/{RANK_FILES[0]}" in after


def _refused(built: Built, root: Path, out: Path, *words: str, **kw: Any) -> MergeError:
    before = snapshot(root)
    cfg = {"base_model": str(built.base), "output_dir": str(root)}
    with pytest.raises(MergeError) as info:
        merge_fsdp_weights(cfg, out, remove_checkpoint_dir=True, quiet=True, **kw)
    for w in words:
        assert w in info.value.message, (w, info.value.message)
    assert snapshot(root) == before
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return info.value


@pytest.mark.parametrize("layout", ["lightning", "titan"])
def test_optimizer_state_in_the_model_files_refuses_before_merging(
    built: Built, tmp_path: Path, layout: str
) -> None:
    """The layout says so (torchtitan step-N/, Lightning .ckpt/); given directly as a DCP
    directory, its entries say so."""
    root = built.root / layout
    model_dir = resolve_checkpoint(root).model_dir
    _refused(built, root, tmp_path / "out", f"{model_dir} holds optimizer state", SHARED)
    err = _refused(built, root, tmp_path / "out", SHARED, checkpoint=model_dir)
    assert "optimizer state (optimizer" in err.message
    assert err.message.endswith("merge without --remove_checkpoint_dir")


def test_a_dcp_directory_with_model_and_optimizer_entries_refuses(
    built: Built, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(built.base).state_dict()
    mixed = tmp_path / "mixed"
    optim = {"state": {"lm_head.weight": {"exp_avg": torch.zeros(3)}}}
    dcp.save({**sd, "optimizer": optim}, checkpoint_id=mixed, no_dist=True)
    _refused(built, mixed, tmp_path / "out", f"{mixed} holds optimizer state", SHARED)


def test_symbolic_links_are_never_followed(built: Built, tmp_path: Path) -> None:
    """The checkpoint path, the model folder or one shard a symbolic link: refused before
    merging, naming the link; nothing removed, nothing written."""
    real = copy(built.ours, tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    _refused(built, link, tmp_path / "out", f"{link} is a symbolic link (to {real})")

    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    for p in (real / "checkpoint-4").iterdir():
        (run / "checkpoint-4" / p.name).symlink_to(p)  # model/ and the rest: links
    _refused(built, run, tmp_path / "out", f"{run / 'checkpoint-4' / 'model'} is a symbolic link")

    model = real / "checkpoint-4" / "model"
    os.rename(model / DISTCP[1], model / "real.distcp")
    (model / DISTCP[1]).symlink_to("real.distcp")  # inside the folder, but still a link
    _refused(built, real, tmp_path / "out", f"{model / DISTCP[1]} is a symbolic link")


def test_a_shard_changed_after_planning_is_not_removed(built: Built, tmp_path: Path) -> None:
    """Deletion re-checks every file first (still the one read); one differs: none removed."""
    run = copy(built.ours, tmp_path / "run")
    plan = plan_removal(resolve_checkpoint(run), run)
    assert sorted(f.relative.name for f in plan.files) == sorted([".metadata", *DISTCP])
    model = run / "checkpoint-4" / "model"
    before = snapshot(model)
    with (model / DISTCP[2]).open("ab") as f:
        f.write(b"x")
    with pytest.raises(MergeError, match=f"{DISTCP[2]}: changed while the merge ran"):
        remove_shards(plan)
    assert set(snapshot(model)) == set(before)
    removed = remove_shards(plan_removal(resolve_checkpoint(run), run))
    assert removed.folder_removed and not model.exists()
    assert sorted(p.name for p in removed.files) == sorted([".metadata", *DISTCP])


def test_cli_refusal_through_a_symbolic_link_is_one_line(built: Built, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(copy(built.ours, tmp_path / "real"), target_is_directory=True)
    (tmp_path / "cfg.yml").write_text(
        json.dumps({"base_model": str(built.base), "output_dir": str(link)})
    )
    args = ["--output_path", str(tmp_path / "out"), "--remove_checkpoint_dir", "--quiet"]
    result = CliRunner().invoke(
        cli, ["merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"), *args]
    )
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "is a symbolic link" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
