"""Assembling full tensors from rank files written by real gloo ranks: bit-exact against the
original weights, equal logits, and clear errors for incomplete or mixed sets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from rank_helpers import full_tensors, logits, make_rank_files
from safetensors.torch import load_file

from shardforge.errors import CheckpointError
from shardforge.formats.rankfiles import Placement, plan_rank_files
from shardforge.formats.rankfiles.rank_plan import local_box
from shardforge.layouts.catalog import resolve_checkpoint


def _check_round_trip(
    model_dir: Path, rank_dir: Path, dtype: torch.dtype, dim0_slabs: bool = True
) -> None:
    original = load_file(model_dir / "model.safetensors")
    plan = plan_rank_files(rank_dir)
    assert set(plan) == set(original)
    merged = {}
    for key, tensor in full_tensors(plan).items():
        assert tensor.dtype == dtype
        assert torch.equal(tensor, original[key]), key
        merged[key] = tensor
    assert torch.equal(logits(model_dir, merged), logits(model_dir))
    # every FSDP2 Shard(0) shard is a dim-0 slab: its bytes can be copied verbatim
    for key, tp in plan.items():
        slabs = tp.slabs()
        if not dim0_slabs and len(tp.shape) == 2:
            assert slabs is None, key
            continue
        assert slabs is not None, key
        buf = bytearray(tp.nbytes)
        for slab in slabs:
            with slab.path.open("rb") as fh:
                fh.seek(slab.src_offset)
                buf[slab.dst_offset : slab.dst_offset + slab.nbytes] = fh.read(slab.nbytes)
        rebuilt = torch.frombuffer(buf, dtype=dtype).view(tp.shape)
        assert torch.equal(rebuilt, original[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["ranks_2_fp32", "ranks_3_bf16"])
def test_round_trip_bit_exact(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir, rank_dir = request.getfixturevalue(fixture)
    dtype = torch.float32 if fixture.endswith("fp32") else torch.bfloat16
    _check_round_trip(model_dir, rank_dir, dtype)


@pytest.mark.slow
def test_plan_describes_uneven_shards(ranks_3_bf16: tuple[Path, Path]) -> None:
    _, rank_dir = ranks_3_bf16
    plan = plan_rank_files(rank_dir)
    emb = plan["model.embed_tokens.weight"]
    assert emb.shape == (331, 70) and emb.dtype == torch.bfloat16
    assert emb.placements == (Placement("shard", 0),) and emb.mesh_shape == (3,)
    # torch.chunk: ceil(331 / 3) = 111 rows, the last rank 109
    assert [(p.rank, p.offsets, p.sizes) for p in emb.pieces] == [
        (0, (0, 0), (111, 70)),
        (1, (111, 0), (111, 70)),
        (2, (222, 0), (109, 70)),
    ]
    k_proj = plan["model.layers.0.self_attn.k_proj.weight"]  # 14 rows: 5, 5, 4
    assert [p.sizes[0] for p in k_proj.pieces] == [5, 5, 4]
    assert emb.nbytes == 331 * 70 * 2


@pytest.mark.slow
def test_hsdp_replicate_shard_mesh(tmp_path: Path) -> None:
    """HSDP: mesh (2 replicas, 2 shards), placements (Replicate(), Shard(0)); the replicas'
    copies are read once (from the lowest rank)."""
    model_dir, rank_dir = make_rank_files(tmp_path, 4, "float32", mesh_shape=(2, 2))
    plan = plan_rank_files(rank_dir)
    norm = plan["model.norm.weight"]
    assert norm.placements == (Placement("replicate"), Placement("shard", 0))
    assert norm.mesh_shape == (2, 2)
    assert [(p.rank, p.offsets) for p in norm.pieces] == [(0, (0,)), (1, (35,))]
    _check_round_trip(model_dir, rank_dir, torch.float32)
    # half of the ranks renamed as a complete 2-rank set: the mesh says 4 ranks
    half = tmp_path / "half"
    half.mkdir()
    for r in (0, 1):
        shutil.copy(
            rank_dir / f"model_world_size_4_rank_{r}.pt", half / f"model_world_size_2_rank_{r}.pt"
        )
    with pytest.raises(
        CheckpointError, match=r"lies on 4 ranks \(mesh \(2, 2\)\), 2 rank files found"
    ):
        plan_rank_files(half)


@pytest.mark.slow
def test_shard_dim_1(tmp_path: Path) -> None:
    """FSDP2 with shard_placement_fn -> Shard(1) for matrices: column blocks, assembled in memory."""
    model_dir, rank_dir = make_rank_files(tmp_path, 2, "float32", matrix_shard_dim=1)
    plan = plan_rank_files(rank_dir)
    emb = plan["model.embed_tokens.weight"]
    assert emb.placements == (Placement("shard", 1),)
    assert [(p.offsets, p.sizes) for p in emb.pieces] == [((0, 0), (331, 32)), ((0, 32), (331, 32))]
    _check_round_trip(model_dir, rank_dir, torch.float32, dim0_slabs=False)


def test_local_box_matches_torch_chunking() -> None:
    shard0, rep = Placement("shard", 0), Placement("replicate")
    sizes = [local_box((10, 3), (shard0,), (4,), (c,)) for c in range(4)]
    assert sizes == [((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (3, 3)), ((9, 0), (1, 3))]
    # more ranks than rows: trailing ranks hold empty shards at the end
    assert local_box((2, 3), (shard0,), (3,), (2,)) == ((2, 0), (0, 3))
    assert local_box((5,), (rep, shard0), (2, 2), (1, 1)) == ((3,), (2,))
    # two mesh dims sharding the same tensor dim nest (mesh dim 0 first)
    assert local_box((8,), (shard0, shard0), (2, 2), (1, 0)) == ((4,), (2,))
    for n in (2, 3, 4, 7):
        t = torch.arange(29)
        chunks = torch.chunk(t, n)
        for c in range(n):
            (off,), (size,) = local_box((29,), (shard0,), (n,), (c,))
            expected = chunks[c] if c < len(chunks) else t[:0]
            assert torch.equal(t[off : off + size], expected)


@pytest.mark.slow
def test_missing_rank_file(ranks_2_fp32: tuple[Path, Path], tmp_path: Path) -> None:
    _, rank_dir = ranks_2_fp32
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(rank_dir / "model_world_size_2_rank_0.pt", partial)
    with pytest.raises(CheckpointError, match=r"missing: model_world_size_2_rank_1\.pt"):
        plan_rank_files(partial)


@pytest.mark.slow
def test_mixed_world_sizes(
    ranks_2_fp32: tuple[Path, Path], ranks_3_bf16: tuple[Path, Path], tmp_path: Path
) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(ranks_2_fp32[1], mixed)
    shutil.copy(ranks_3_bf16[1] / "model_world_size_3_rank_0.pt", mixed)
    with pytest.raises(CheckpointError, match=r"different world sizes \(2, 3\)"):
        plan_rank_files(mixed)


@pytest.mark.slow
def test_files_of_different_runs_disagree(ranks_3_bf16: tuple[Path, Path], tmp_path: Path) -> None:
    """A rank file renamed into another run's set: its metadata disagrees and is reported."""
    other = tmp_path / "other"
    shutil.copytree(ranks_3_bf16[1], other)
    (other / "model_world_size_3_rank_2.pt").unlink()
    shutil.copy(other / "model_world_size_3_rank_1.pt", other / "model_world_size_3_rank_2.pt")
    with pytest.raises(
        CheckpointError,
        match=r"rank_2\.pt and model_world_size_3_rank_1\.pt hold the same mesh position",
    ):
        plan_rank_files(other)


def test_ranks_that_disagree(tmp_path: Path) -> None:
    """Keys, shapes or dtypes that differ between ranks are reported with the file."""
    cases = {
        "keys": ({"a": torch.ones(2), "b": torch.ones(2)}, {"a": torch.ones(2)}, "keys differ"),
        "shape": ({"a": torch.ones(2)}, {"a": torch.ones(3)}, r"'a' is torch.float32 \[3\]"),
        "dtype": ({"a": torch.ones(2)}, {"a": torch.ones(2).half()}, "'a' is torch.float16"),
    }
    for name, (rank0, rank1, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        torch.save(rank0, d / "model_world_size_2_rank_0.pt")
        torch.save(rank1, d / "model_world_size_2_rank_1.pt")
        with pytest.raises(CheckpointError, match=rf"rank_1\.pt: .*{message}"):
            plan_rank_files(d)


def test_no_rank_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no model_world_size_<W>_rank_<R>\.pt files"):
        plan_rank_files(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        plan_rank_files(tmp_path / "nope")


@pytest.mark.slow
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

    found = resolve_checkpoint(root)
    assert found.model_dir == root / "global_step_4" / "actor"
    merged = full_tensors(plan_rank_files(found.model_dir))
    original = load_file(model_dir / "model.safetensors")
    assert merged.keys() == original.keys()
    assert all(torch.equal(merged[k], original[k]) for k in original)
    assert torch.equal(logits(model_dir, merged), logits(model_dir))
