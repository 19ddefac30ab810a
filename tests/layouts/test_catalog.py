"""Finding the model DCP directory in each trainer's layout (directories built as they write
them; the marker files stand in for the DCP contents, which this stage does not read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.layouts.catalog import resolve_checkpoint


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
    with pytest.raises(CheckpointError, match="no complete checkpoint found") as info:
        resolve_checkpoint(tmp_path)
    assert "\n" not in info.value.message  # the layouts looked for are details
    assert "- checkpoint-N/model/ (shardforge)" in info.value.details
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


def test_several_lightning_last_folders_are_ordered_by_meta_pt_or_refused(tmp_path: Path) -> None:
    """Bug: `last.ckpt` and `last-v1.ckpt` both sort as "last"; the first found was taken."""
    import torch

    ckpts = tmp_path / "checkpoints"
    torch.save({"global_step": 40}, dcp_dir(ckpts / "last.ckpt") / "meta.pt")
    torch.save({"global_step": 90}, dcp_dir(ckpts / "last-v1.ckpt") / "meta.pt")
    assert resolve_checkpoint(tmp_path).model_dir.name == "last-v1.ckpt"
    torch.save({"global_step": 90}, ckpts / "last.ckpt" / "meta.pt")  # the same step: no answer
    with pytest.raises(CheckpointError, match="2 checkpoints are the latest") as info:
        resolve_checkpoint(tmp_path)
    assert sorted(d.split("/")[-1].split(" ")[0] for d in info.value.details) == [
        "last-v1.ckpt",
        "last.ckpt",
    ]
    assert "--checkpoint" in info.value.message


def test_a_step_in_two_layouts_is_refused_not_picked_by_table_order(tmp_path: Path) -> None:
    """Bug: checkpoint-5 holding both our model/ and HF Trainer's pytorch_model_fsdp_0/ was
    merged from whichever layout came first in the table."""
    dcp_dir(tmp_path / "checkpoint-5" / "model")
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("{}")
    dcp_dir(tmp_path / "checkpoint-5" / "pytorch_model_fsdp_0")
    for step in (None, 5):
        with pytest.raises(CheckpointError, match="2 checkpoints are") as info:
            resolve_checkpoint(tmp_path, step=step)
        assert {d.split("(")[-1] for d in info.value.details} == {"shardforge)", "hf-trainer)"}
    # naming the model folder settles it
    got = resolve_checkpoint(tmp_path, state_dict_dirname="pytorch_model_fsdp_0")
    assert got.model_dir.name == "pytorch_model_fsdp_0"


def test_a_full_model_directory_is_explained(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="full Hugging Face model already") as full:
        resolve_checkpoint(tmp_path)
    assert "FULL_STATE_DICT" not in str(full.value) and "verify" not in str(full.value)
    (tmp_path / "shardforge-manifest.json").write_text("{}")  # a merge's output
    with pytest.raises(CheckpointError, match="already \\(merged") as merged:
        resolve_checkpoint(tmp_path)
    assert f"shardforge verify {tmp_path}" in str(merged.value)


def rank_dir(path: Path, world_size: int = 2) -> Path:
    path.mkdir(parents=True)
    for r in range(world_size):
        (path / f"model_world_size_{world_size}_rank_{r}.pt").write_bytes(b"")
    return path


def test_verl_latest_file_and_huggingface_folder(tmp_path: Path) -> None:
    from shardforge.formats.registry import RANK_FILES

    for step in (100, 200):
        actor = rank_dir(tmp_path / f"global_step_{step}" / "actor")
        (actor / "huggingface").mkdir()
        (actor / "huggingface" / "config.json").write_text("{}")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step, got.kind) == ("verl", 200, RANK_FILES)
    assert got.hf_dir == tmp_path / "global_step_200" / "actor" / "huggingface"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100\n")
    assert resolve_checkpoint(tmp_path).step == 100
    assert resolve_checkpoint(tmp_path, step=200).step == 200
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(CheckpointError, match="expected a step number"):
        resolve_checkpoint(tmp_path)


def test_lmms_engine_rank_files_and_ema_folder(tmp_path: Path) -> None:
    for step in (1, 2):
        rank_dir(tmp_path / f"checkpoint-{step}" / "pytorch_model_fsdp_0")
        rank_dir(tmp_path / f"checkpoint-{step}" / "pytorch_ema_model_fsdp_0")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step, got.kind) == ("lmms-engine", 2, "rank-files")
    assert got.model_dir.name == "pytorch_model_fsdp_0"
    ema = resolve_checkpoint(tmp_path, step=1, state_dict_dirname="pytorch_ema_model_fsdp_0")
    assert ema.model_dir == tmp_path / "checkpoint-1" / "pytorch_ema_model_fsdp_0"
    # a single checkpoint-N folder given directly, with the EMA folder picked inside it
    single = resolve_checkpoint(tmp_path / "checkpoint-2", None, "pytorch_ema_model_fsdp_0")
    assert single.model_dir == tmp_path / "checkpoint-2" / "pytorch_ema_model_fsdp_0"
    with pytest.raises(CheckpointError, match="no checkpoint has a 'nope' folder"):
        resolve_checkpoint(tmp_path, state_dict_dirname="nope")
    for bad in ("..", "../checkpoint-1", "/abs", "a/../../b"):
        with pytest.raises(CheckpointError, match="inside the checkpoint"):
            resolve_checkpoint(tmp_path, state_dict_dirname=bad)


def test_rank_files_in_the_step_folder_itself(tmp_path: Path) -> None:
    rank_dir(tmp_path / "checkpoint-7")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.model_dir) == ("lmms-engine", tmp_path / "checkpoint-7")


def test_torchtitan_step_folders(tmp_path: Path) -> None:
    from shardforge.keymap.keys import TORCHTITAN
    from shardforge.layouts.catalog import scan

    for step in (10, 20):
        dcp_dir(tmp_path / f"step-{step}")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step, got.adapter) == ("torchtitan", 20, TORCHTITAN)
    assert resolve_checkpoint(tmp_path / "step-10").adapter == TORCHTITAN
    assert [c.step for c in sorted(scan(tmp_path).candidates, key=lambda c: c.step)] == [10, 20]


def test_a_newer_full_model_save_stops_the_merge(tmp_path: Path) -> None:
    """checkpoint-30 is sharded, the run then wrote its final full model (step 40): merging the
    older shards silently would lose 10 steps. --step merges them anyway."""
    import os

    run = tmp_path / "run"
    dcp_dir(run / "checkpoint-30" / "model")
    (run / "checkpoint-30" / "trainer_state.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"x")
    old = (run / "checkpoint-30" / "model" / ".metadata").stat().st_mtime
    os.utime(run / "model.safetensors", (old + 60, old + 60))
    with pytest.raises(CheckpointError, match=r"full-model save .*--step 30"):
        resolve_checkpoint(run)
    assert resolve_checkpoint(run, step=30).step == 30
    # an older full save (the base model copied in first) does not stop it
    os.utime(run / "model.safetensors", (old - 60, old - 60))
    assert resolve_checkpoint(run).step == 30
    # HF Trainer: a later step folder holding full weights
    (run / "checkpoint-40").mkdir()
    (run / "checkpoint-40" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"checkpoint-40/model.safetensors.index.json"):
        resolve_checkpoint(run)


def test_an_unfinished_save_is_named(tmp_path: Path) -> None:
    """A step folder whose model folder has .distcp files but no .metadata is the reason no
    checkpoint is found: the error says which folder and why, in its first line."""
    run = tmp_path / "run"
    (run / "checkpoint-4" / "pytorch_model_fsdp_0").mkdir(parents=True)
    (run / "checkpoint-4" / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"x")
    (run / "step-2").mkdir()
    (run / "step-2" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(run)
    assert info.value.message == (
        f"{run}: no complete checkpoint: checkpoint-4/pytorch_model_fsdp_0 has .distcp files "
        "but no .metadata: the save did not finish"
    )
    assert info.value.details == [
        "step-2 has .distcp files but no .metadata: the save did not finish"
    ]


def test_every_layout_says_where_its_training_state_lives() -> None:
    """The removal decision is data: each layout a candidate can carry has a row, and the ones
    that keep optimizer state inside the model's shard files say so."""
    from shardforge.formats.registry import FORMATS
    from shardforge.layouts.layout import LAYOUTS

    names = [row.name for row in LAYOUTS]
    assert len(names) == len(set(names))
    # a folder of each sharded format can be given directly
    assert {row.name for row in LAYOUTS if row.direct} == {f.name for f in FORMATS if f.sharded}
    assert {row.name for row in LAYOUTS if row.state_shared} == {"torchtitan", "lightning"}
    assert all(row.state_beside and row.looked_for for row in LAYOUTS)
    # every format a layout names is a sharded format of the registry
    sharded = {f.name for f in FORMATS if f.sharded}
    assert {fmt for row in LAYOUTS for fmt in row.formats} == sharded


def _files(path: Path, *names: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).write_bytes(b"")
    return path


ACCELERATE_BIN = ("pytorch_model_fsdp_0_rank0.bin", "pytorch_model_fsdp_0_rank1.bin")
DCP_RANKS = ("__0.metadata", "__1.metadata", "__0_0.distcp", "__1_0.distcp")
SHARDS = (
    "shard-00001-model-00001-of-00001.safetensors",
    "shard-00002-model-00001-of-00001.safetensors",
)


def test_accelerate_per_rank_bin_files(tmp_path: Path) -> None:
    """save_fsdp_model(use_dcp=False) writes into the folder it is given: accelerate's
    automatic checkpoint_N, or HF Trainer's checkpoint-N."""
    for step in (3, 12):
        _files(tmp_path / "checkpoints" / f"checkpoint_{step}", *ACCELERATE_BIN)
    got = resolve_checkpoint(tmp_path / "checkpoints")
    assert (got.layout, got.step, got.kind) == ("accelerate-per-rank", 12, "accelerate-bin")
    assert resolve_checkpoint(tmp_path / "checkpoints", step=3).model_dir.name == "checkpoint_3"
    _files(tmp_path / "trainer" / "checkpoint-7", *ACCELERATE_BIN, "optimizer_0_rank0.bin")
    assert resolve_checkpoint(tmp_path / "trainer").step == 7
    given = resolve_checkpoint(tmp_path / "checkpoints" / "checkpoint_3")
    assert (given.layout, given.kind) == ("accelerate-bin", "accelerate-bin")


def test_collective_free_dcp_steps(tmp_path: Path) -> None:
    """Per-rank __R.metadata and no .metadata: a complete save of its own format, not an
    unfinished DCP."""
    _files(tmp_path / "checkpoint-2", *DCP_RANKS)
    _files(tmp_path / "step-9" / "model", *DCP_RANKS)
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step, got.kind) == ("collective-free-dcp", 9, "dcp-ranks")
    assert got.model_dir == tmp_path / "step-9" / "model" and got.adapter is None
    assert resolve_checkpoint(tmp_path, step=2).model_dir == tmp_path / "checkpoint-2"
    given = resolve_checkpoint(tmp_path / "checkpoint-2")
    assert (given.layout, given.kind) == ("dcp-ranks", "dcp-ranks")
    (tmp_path / "checkpoint-2" / ".metadata").write_bytes(b"")  # a global .metadata wins
    assert resolve_checkpoint(tmp_path / "checkpoint-2").kind == "dcp"


def test_torchtitan_last_save_in_hf(tmp_path: Path) -> None:
    """torchtitan's last step in Hugging Face safetensors (sharded/ and torch's consolidated
    files) beside its DCP steps: Hugging Face names, no name adapter."""
    from shardforge.keymap.keys import TORCHTITAN
    from shardforge.layouts.catalog import scan

    dcp_dir(tmp_path / "step-10")
    last = _files(tmp_path / "step-20" / "sharded", *SHARDS).parent
    _files(last, "model-00001-of-00001.safetensors", "model.safetensors.index.json")
    got = resolve_checkpoint(tmp_path)
    assert (got.layout, got.step, got.kind, got.adapter) == (
        "torchtitan-hf",
        20,
        "dcp-safetensors",
        None,
    )
    assert resolve_checkpoint(tmp_path, step=10).adapter == TORCHTITAN
    assert sorted((c.step, c.layout) for c in scan(tmp_path).candidates) == [
        (10, "torchtitan"),
        (20, "torchtitan-hf"),
    ]
    shards = resolve_checkpoint(last / "sharded")
    assert (shards.layout, shards.model_dir) == ("dcp-safetensors", last / "sharded")
