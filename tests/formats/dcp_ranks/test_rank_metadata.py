"""Collective-free DCP (`formats.dcp_ranks`): ``dcp.save(..., use_collectives=False)`` on 2 gloo
ranks (`helpers.shared.saved_formats`) writes ``__R.metadata`` per rank and no ``.metadata``;
every rank's metadata is read and cross-checked as one. The merge is bit-exact and gives the
trained logits; `inspect`, `--all_steps` and `--remove_checkpoint_dir` reach it through its
rows; a replicated tensor (every rank's copy) is read once, its other copies kept for the source
to compare (`test_source`); incomplete saves, overlapping chunks, ranks that disagree and metadata
of another rank are refused in one line; ranks are taken in numeric order (__10 after __9)."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.shared import REPLICATED, merge_refused, merges_to_the_trained_model
from shardforge.errors import CheckpointError
from shardforge.formats.dcp_ranks.rank_metadata import (
    list_rank_metadata,
    read_rank_metadata,
)
from shardforge.inspection import inspect_checkpoint
from shardforge.merge.api import merge_fsdp_weights

pytestmark = pytest.mark.slow  # the checkpoints are written by 2 gloo ranks

KEY = "model.embed_tokens.weight"  # 331 rows: rank 0 holds [0, 166), rank 1 [166, 331)


def _cfg(saved: Path, out: Path) -> dict[str, str]:
    return {"base_model": str(saved / "base"), "output_dir": str(out)}


def _copy(saved: Path, tmp_path: Path, name: str = "checkpoint-2") -> Path:
    src = saved / "collective-free" / "checkpoint-2"
    return Path(shutil.copytree(src, tmp_path / "run" / name))


def _rewrite(path: Path, change: Callable[[Any], None]) -> None:
    """Change a metadata file torch wrote (a test's own file: plain pickle is fine here)."""
    with path.open("rb") as f:
        meta = pickle.load(f)
    change(meta)
    with path.open("wb") as f:
        pickle.dump(meta, f)


def test_the_merge_is_bit_exact_and_gives_the_trained_logits(saved: Path, tmp_path: Path) -> None:
    ckpt = saved / "collective-free" / "checkpoint-2"
    assert not (ckpt / ".metadata").exists() and (ckpt / "__1.metadata").is_file()
    merges_to_the_trained_model(saved, ckpt, tmp_path / "merged")


def test_each_chunk_once_and_a_replica_read_from_the_lowest_rank(saved: Path) -> None:
    meta = read_rank_metadata(saved / "contract" / "dcp-ranks")
    (replica,) = meta.tensors[REPLICATED].chunks  # both ranks saved it whole
    assert replica.file.name == "__0_0.distcp"
    embed = meta.tensors["model.embed.weight"].chunks  # 7 rows: 4 on rank 0, 3 on rank 1
    assert [(c.offsets, c.sizes, c.file.name) for c in embed] == [
        ((0, 0), (4, 6), "__0_0.distcp"),
        ((4, 0), (3, 6), "__1_0.distcp"),
    ]


def test_ranks_in_numeric_order(tmp_path: Path) -> None:
    for rank in range(12):
        (tmp_path / f"__{rank}.metadata").touch()
    assert list(list_rank_metadata(tmp_path)) == list(range(12))


def test_inspect_all_steps_and_removal(saved: Path, tmp_path: Path) -> None:
    run = _copy(saved, tmp_path).parent
    _copy(saved, tmp_path, "checkpoint-5")
    facts = inspect_checkpoint(run)
    assert (facts.layout, facts.step, facts.contents.storage) == (
        "collective-free-dcp",
        5,
        "dcp-ranks",
    )
    assert facts.contents.world_size == 2
    assert facts.contents.versions.get("dcp_metadata")
    out = merge_fsdp_weights(
        _cfg(saved, tmp_path), tmp_path / "steps", checkpoint=run, all_steps=True, quiet=True
    )
    assert sorted(p.name for p in out.iterdir()) == ["step-2", "step-5"]
    merge_fsdp_weights(
        _cfg(saved, tmp_path),
        tmp_path / "removed",
        checkpoint=run / "checkpoint-5",
        verify=True,
        remove_checkpoint_dir=True,
        quiet=True,
    )
    assert not (run / "checkpoint-5").exists() and (run / "checkpoint-2").is_dir()


def test_an_incomplete_save_is_refused(saved: Path, tmp_path: Path) -> None:
    base, ckpt = saved / "base", _copy(saved, tmp_path)
    data = (ckpt / "__1_0.distcp").read_bytes()
    (ckpt / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    assert "truncated" in merge_refused(base, ckpt, tmp_path / "a")
    (ckpt / "__1_0.distcp").write_bytes(data)
    shutil.move(ckpt / "__1.metadata", tmp_path / "kept")
    assert "__1.metadata is missing" in merge_refused(base, ckpt, tmp_path / "b")
    (ckpt / "__1_0.distcp").unlink()  # rank 1 gone altogether: its shards are missing
    assert "cover" in merge_refused(base, ckpt, tmp_path / "c")


def test_overlapping_chunks_are_refused(saved: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint.metadata as m

    def overlap(meta: Any) -> None:
        entry = meta.state_dict_metadata[KEY]
        entry.chunks[0] = dataclasses.replace(entry.chunks[0], offsets=torch.Size([100, 0]))
        (index,) = [i for i in meta.storage_data if i.fqn == KEY]
        moved = m.MetadataIndex(KEY, torch.Size([100, 0]), index.index)
        meta.storage_data[moved] = meta.storage_data.pop(index)

    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "__1.metadata", overlap)
    assert "overlap" in merge_refused(saved / "base", ckpt, tmp_path / "out")


def test_ranks_that_disagree_are_refused(saved: Path, tmp_path: Path) -> None:
    def half(meta: Any) -> None:
        meta.state_dict_metadata[KEY].properties.dtype = torch.float16

    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "__1.metadata", half)
    message = merge_refused(saved / "base", ckpt, tmp_path / "a")
    assert "the ranks disagree" in message and "__0.metadata" in message
    shutil.copyfile(ckpt / "__0.metadata", ckpt / "__1.metadata")  # rank 0's copied over
    assert "not one of rank 1's" in merge_refused(saved / "base", ckpt, tmp_path / "b")


def test_the_transformers_engine_says_it_reads_plain_dcp_only(saved: Path, tmp_path: Path) -> None:
    ckpt = saved / "collective-free" / "checkpoint-2"
    message = merge_refused(saved / "base", ckpt, tmp_path / "out", engine="transformers")
    assert "plain DCP checkpoints only" in message


def test_a_plain_dcp_reader_points_here(saved: Path) -> None:
    from shardforge.formats.dcp.metadata import read_metadata

    with pytest.raises(CheckpointError, match="dcp-ranks"):
        read_metadata(saved / "collective-free" / "checkpoint-2")
