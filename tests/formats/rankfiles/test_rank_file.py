"""Reading one rank file: the records it yields, bounded reads, and hostile or damaged files."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from rank_helpers import local_tensor
from safetensors.torch import load_file

from shardforge.errors import CheckpointError
from shardforge.formats.rankfiles import Placement, plan_rank_files, read_rank_file


@pytest.mark.slow
def test_records_describe_local_shards(ranks_2_fp32: tuple[Path, Path]) -> None:
    model_dir, rank_dir = ranks_2_fp32
    original = load_file(model_dir / "model.safetensors")
    path = rank_dir / "model_world_size_2_rank_1.pt"
    rf = read_rank_file(path)
    assert (rf.world_size, rf.rank, rf.path) == (2, 1, path)
    assert set(rf.tensors) == set(original)
    rec = rf.tensors["model.embed_tokens.weight"]
    assert rec.is_dtensor and rec.dtype == torch.float32
    assert rec.global_shape == (331, 70) and rec.local_shape == (165, 70)
    assert rec.placements == (Placement("shard", 0),) and str(rec.placements[0]) == "Shard(0)"
    assert rec.mesh_shape == (2,) and rec.coordinate == (1,)
    assert rec.stride == (70, 1) and rec.member.endswith(f"/data/{rec.member.rsplit('/', 1)[1]}")
    # the recorded offset is where the member's bytes start in the file
    with zipfile.ZipFile(path) as zf:
        member_bytes = zf.read(rec.member)
    with path.open("rb") as fh:
        fh.seek(rec.data_offset)
        assert fh.read(len(member_bytes)) == member_bytes
    for key, rec in rf.tensors.items():
        local = local_tensor(rf, key)
        assert local.shape == rec.local_shape
        start = -(-original[key].shape[0] // 2)  # rank 1 holds the second torch.chunk
        assert torch.equal(local, original[key][start:]), key


def test_plain_and_strided_tensors(tmp_path: Path) -> None:
    """A rank file may hold plain tensors too; non-contiguous views are read via their stride."""
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    sd = {"a": base.t(), "b": base[2:5, 3:7], "c": torch.tensor(7, dtype=torch.int64)}
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save(sd, path)
    rf = read_rank_file(path)
    assert not rf.tensors["a"].is_dtensor and not rf.tensors["a"].contiguous
    for key, t in sd.items():
        assert torch.equal(local_tensor(rf, key), t), key
    plan = plan_rank_files(tmp_path)
    assert plan["b"].shape == (3, 4) and plan["c"].shape == ()
    assert plan["a"].slabs() is None and plan["b"].slabs() is None  # must be assembled
    assert plan["c"].slabs() is not None


def test_a_memo_bomb_is_refused_by_its_size_not_after_parsing(tmp_path: Path) -> None:
    """A rank file's pickle of many memo entries (the 48 MB file of 16 million memo puts, at
    test scale) is refused early, naming the memo, not after parsing with "keys differ"."""
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"w": torch.ones(2)}, path)
    bomb = tmp_path / "bomb" / path.name
    bomb.parent.mkdir()
    # None memoized and popped: 3 bytes per entry; then an empty state dict
    _replace_pickle(path, bomb, b"\x80\x02" + b"N\x940" * 200_000 + b"}.")
    with pytest.raises(CheckpointError, match=r"has a memo that exceeds .* entries for a file of"):
        read_rank_file(bomb)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_code_execution_payload_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    marker = tmp_path / "MARKER"
    path = ckpt / "model_world_size_1_rank_0.pt"
    torch.save({"model.norm.weight": torch.ones(3), "x": _Payload(marker)}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"model_world_size_1_rank_0\.pt: refused.*system"):
        read_rank_file(path)
    with pytest.raises(CheckpointError, match="refused"):
        plan_rank_files(ckpt)
    assert not marker.exists()
    assert path.read_bytes() == before and sorted(os.listdir(ckpt)) == [path.name]
    # the payload is live: an unsafe loader would have run it
    probe = tmp_path / "probe.pt"
    shutil.copy(path, probe)
    code = f"import torch; torch.load({str(probe)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True)
    assert marker.exists()


def _replace_pickle(src: Path, dst: Path, payload: bytes) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = payload if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)


@pytest.mark.slow
def test_hostile_pickles_inside_a_real_rank_file(
    ranks_2_fp32: tuple[Path, Path], tmp_path: Path
) -> None:
    src = ranks_2_fp32[1] / "model_world_size_2_rank_0.pt"
    dst = tmp_path / "model_world_size_2_rank_0.pt"
    cases = {
        # a global outside the allow-list
        b"cbuiltins\neval\n(S'1'\ntR.": "builtins.eval",
        # setting attributes on an allowed callable (BUILD on a non-record)
        b"ctorch\nSize\n}S'x'\nK\x01sb.": "sets the state of a function",
        # a placement where a state dict belongs
        b"ctorch.distributed.tensor.placement_types\n_StridedShard\n)\x81.": "a _Strided, not",
        b"ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n.": "FSDP1 ShardedTensor",
        b"garbage": "damaged",
        pickle.dumps([1, 2], protocol=2): "not a state dict",
        pickle.dumps({"k": 3}, protocol=2): "'k' holds int",
    }
    for payload, message in cases.items():
        _replace_pickle(src, dst, payload)
        with pytest.raises(CheckpointError, match=message) as info:
            read_rank_file(dst)
        assert str(dst) in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(ranks_2_fp32: tuple[Path, Path], tmp_path: Path, keep: float) -> None:
    src = ranks_2_fp32[1] / "model_world_size_2_rank_1.pt"
    dst = tmp_path / src.name
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"rank_1\.pt: .*(damaged or truncated|truncated)"):
        read_rank_file(dst)


def test_compressed_record_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.zeros(64)}, src)
    dst = tmp_path / "model_world_size_1_rank_0.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(CheckpointError, match=r"unsupported zip feature.*compressed"):
        read_rank_file(dst)


def test_bad_names(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not named model_world_size"):
        read_rank_file(tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="rank 2 is not below world size 2"):
        read_rank_file(tmp_path / "model_world_size_2_rank_2.pt")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_rank_file(tmp_path / "model_world_size_2_rank_1.pt")
