"""DCP's safetensors storage, sharded (`formats.dcp_safetensors.sharded`):
``HuggingFaceStorageWriter(save_distributed=True)`` on 2 gloo ranks
(`helpers.shared.saved_formats`). The merge is bit-exact and gives the trained logits, on one
process and on two; integer, bool and uint8 tensors are read exactly (torch's own consolidator
refuses them); `inspect` and `--remove_checkpoint_dir` reach it through its row; damaged,
overlapping, disagreeing and incomplete shard files are refused in one line."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from helpers.shared import (
    contract_tensors,
    merge_refused,
    merges_to_the_trained_model,
    tree_digest,
)
from shardforge.cli.main import cli
from shardforge.formats.dcp_safetensors.sharded import ShardedSource, plan_shards
from shardforge.inspection import inspect_checkpoint
from shardforge.io.copy import ReadCache
from shardforge.merge.api import merge_fsdp_weights

pytestmark = pytest.mark.slow  # the checkpoints are written by 2 gloo ranks

SHARD_1 = "shard-00001-model-00001-of-00001.safetensors"
SHARD_2 = "shard-00002-model-00001-of-00001.safetensors"
KEY = "model.embed_tokens.weight"  # 331 rows: shard 1 holds [0, 166), shard 2 [166, 331)


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved / "hf-sharded", tmp_path / "sharded"))


def rewrite_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the JSON header of a safetensors file (the tensor bytes stay where they are)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


def _sharding(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """A header change of the DCP_SHARDING_INFO object."""

    def run(header: dict[str, Any]) -> None:
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        change(info)
        header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)

    return run


def test_the_merge_is_bit_exact_and_gives_the_trained_logits(saved: Path, tmp_path: Path) -> None:
    merges_to_the_trained_model(saved, saved / "hf-sharded", tmp_path / "merged")


def test_two_ranks_write_the_single_process_bytes(saved: Path, tmp_path: Path) -> None:
    """The distributed merge (torchrun, gloo) reads each rank's rows of the shard files."""
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(saved / "base"), "output_dir": "unused"}))
    outs = {}
    for name, extra in (("one", []), ("two", ["--nproc_per_node", "2", "--verify"])):
        args = [str(cfg), "--output_path", str(tmp_path / name), "--quiet"]
        args += ["--checkpoint", str(saved / "hf-sharded"), *extra]
        result = CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", *args])
        assert result.exit_code == 0, result.output
        outs[name] = tree_digest(tmp_path / name)
    assert outs["one"] == outs["two"]


def test_integer_bool_and_uint8_tensors_are_read_exactly(saved: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )

    folder = saved / "contract" / "dcp-safetensors"
    want = contract_tensors()
    with ReadCache() as reader:
        got = {k: ShardedSource(t, folder).read(reader) for k, t in plan_shards(folder).items()}
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(TypeError):  # torch's consolidator: torch.finfo of an integer dtype
        consolidate_safetensors_files(str(folder), str(tmp_path), dict.fromkeys(want, 1))


def test_inspect_and_removal(saved: Path, tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)
    facts = inspect_checkpoint(ckpt)
    assert (facts.layout, facts.contents.storage, facts.contents.world_size) == (
        "dcp-safetensors",
        "dcp-safetensors",
        2,
    )
    assert len(facts.tensors) == len(load_file(saved / "trained" / "model.safetensors"))
    cfg = {"base_model": str(saved / "base"), "output_dir": str(tmp_path)}
    merge_fsdp_weights(
        cfg, tmp_path / "out", checkpoint=ckpt, verify=True, remove_checkpoint_dir=True, quiet=True
    )
    assert not ckpt.exists()


def test_damaged_and_incomplete_shard_files_are_refused(saved: Path, tmp_path: Path) -> None:
    base, ckpt = saved / "base", _copy(saved, tmp_path)
    shard2 = ckpt / SHARD_2
    data = shard2.read_bytes()
    shard2.write_bytes(data[: len(data) - 100])
    assert SHARD_2 in merge_refused(base, ckpt, tmp_path / "a")
    shard2.write_bytes(data)
    shutil.move(ckpt / SHARD_1, tmp_path / "kept")
    assert "no file of shard 00001" in merge_refused(base, ckpt, tmp_path / "b")
    shutil.move(tmp_path / "kept", ckpt / SHARD_1)
    shutil.copyfile(shard2, ckpt / "shard-00003-model-00001-of-00002.safetensors")
    assert "different saves" in merge_refused(base, ckpt, tmp_path / "c")


def test_overlapping_and_disagreeing_shards_are_refused(saved: Path, tmp_path: Path) -> None:
    base, ckpt = saved / "base", _copy(saved, tmp_path)
    shard2 = ckpt / SHARD_2
    data = shard2.read_bytes()
    rewrite_header(shard2, _sharding(lambda info: info[KEY].update(saved_offsets=[100, 0])))
    assert "overlap" in merge_refused(base, ckpt, tmp_path / "a")
    shard2.write_bytes(data)
    rewrite_header(shard2, lambda header: header[KEY].update(dtype="I32"))
    assert "the shard files disagree" in merge_refused(base, ckpt, tmp_path / "b")
    shard2.write_bytes(data)
    rewrite_header(shard2, lambda header: header["__metadata__"].pop("DCP_SHARDING_INFO"))
    assert "no DCP_SHARDING_INFO" in merge_refused(base, ckpt, tmp_path / "c")
    shard2.write_bytes(data)
    rewrite_header(shard2, _sharding(lambda info: info.pop(KEY)))
    assert "naming exactly the file's tensors" in merge_refused(base, ckpt, tmp_path / "d")
