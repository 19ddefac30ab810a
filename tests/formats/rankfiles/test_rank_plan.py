"""Assembling full tensors from rank files written by real gloo ranks: bit-exact against the
original weights, equal logits, and clear errors for incomplete or mixed sets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from rank_helpers import full_tensors, logits
from safetensors.torch import load_file

from shardforge.errors import CheckpointError
from shardforge.formats.rankfiles import Placement, plan_rank_files
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
def test_hsdp_replicate_shard_mesh(mesh_root: Path, tmp_path: Path) -> None:
    """HSDP: mesh (2 replicas, 2 shards), placements (Replicate(), Shard(0)); the replicas'
    copies are read once (from the lowest rank) and the others compared."""
    rank_dir = mesh_root / "hsdp"
    plan = plan_rank_files(rank_dir)
    norm = plan["model.norm.weight"]
    assert norm.placements == (Placement("replicate"), Placement("shard", 0))
    assert norm.mesh_shape == (2, 2)
    assert [(p.rank, p.offsets) for p in norm.pieces] == [(0, (0,)), (1, (32,))]
    assert [(c.rank, p.rank) for c, p in norm.copies] == [(2, 0), (3, 1)]
    _check_round_trip(mesh_root / "base", rank_dir, torch.float32)
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
def test_shard_dim_1(shard_dim_1: tuple[Path, Path]) -> None:
    """FSDP2 with shard_placement_fn -> Shard(1) for matrices: column blocks, assembled in memory."""
    model_dir, rank_dir = shard_dim_1
    plan = plan_rank_files(rank_dir)
    emb = plan["model.embed_tokens.weight"]
    assert emb.placements == (Placement("shard", 1),)
    assert [(p.offsets, p.sizes) for p in emb.pieces] == [((0, 0), (331, 32)), ((0, 32), (331, 32))]
    _check_round_trip(model_dir, rank_dir, torch.float32, dim0_slabs=False)


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
    with pytest.raises(CheckpointError, match=r"rank_2\.pt: .* was saved by rank 1: .* renamed"):
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


# ------------------------------------------------------------------------ 2-D meshes (gloo x4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.slow
def test_fsdp_tp_mesh_merges_bit_exact(mesh_root: Path, tmp_path: Path) -> None:
    """FSDP2 + TP on a 2x2 mesh, saved per rank as verl does: planned from the placements,
    merged (and verified) bit for bit, loaded by transformers with the same logits."""
    from shardforge.merge.api import merge_fsdp_weights

    plan = plan_rank_files(mesh_root / "tp")
    q = plan["model.layers.0.self_attn.q_proj.weight"]
    assert q.placements == (Placement("strided", 0, 2), Placement("shard", 0))
    assert [(p.rank, p.offsets) for p in q.pieces] == [
        (0, (0, 0)),
        (1, (32, 0)),
        (2, (16, 0)),
        (3, (48, 0)),
    ]
    assert q.slabs() is not None  # FSDP2's rows of TP's rows: whole rows, copied file to file
    o = plan["model.layers.0.self_attn.o_proj.weight"]
    assert o.placements == (Placement("shard", 0), Placement("shard", 1)) and o.slabs() is None
    emb = plan["model.embed_tokens.weight"]  # on the dp sub-mesh: the tp ranks hold copies
    assert emb.mesh_shape == (2,) and [(c.rank, p.rank) for c, p in emb.copies] == [(1, 0), (3, 2)]

    base = mesh_root / "base"
    out = merge_fsdp_weights(
        {"base_model": str(base), "output_dir": str(tmp_path)},
        tmp_path / "merged",
        checkpoint=mesh_root / "tp",
        verify=True,
        quiet=True,
    )
    original = load_file(base / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    assert merged.keys() == original.keys()
    assert all(torch.equal(_bits(merged[k]), _bits(original[k])) for k in original)
    assert torch.equal(logits(out), logits(base))


@pytest.mark.slow
def test_every_placement_mix_is_assembled_exactly(mesh_root: Path) -> None:
    """(Replicate, Shard), (Shard, Replicate), (Shard, Shard) on two dims and on one,
    strided shards, float8 and int64: each full tensor bit for bit, by the merge's sources and
    by the independent reader (torch's own placement code)."""
    from shardforge.formats.base import StoredTensor
    from shardforge.formats.rankfiles.reference import RankFilesReference

    expected = torch.load(mesh_root / "placements.pt", weights_only=True)
    plan = plan_rank_files(mesh_root / "placements")
    got = full_tensors(plan)
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(_bits(got[key]), _bits(tensor)), key
    assert plan["shard_shard"].placements == (Placement("shard", 0), Placement("shard", 1))
    assert [p.runs[0] for p in plan["strided_alone"].pieces] == [((0, 2), (4, 2)), ((2, 2), (6, 2))]
    assert len(plan["int_replicated"].copies) == 3 and len(plan["replicate_shard"].copies) == 2
    wanted = [
        StoredTensor("rank-files", mesh_root / "placements", k, t.dtype, tuple(t.shape))
        for k, t in expected.items()
    ]
    reference = RankFilesReference(mesh_root / "placements").load(wanted)
    assert all(torch.equal(_bits(reference[k]), _bits(t)) for k, t in expected.items())


@pytest.mark.slow
def test_replicated_copies_that_differ_are_one_error(mesh_root: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        full_tensors(plan_rank_files(mesh_root / "diverged"))
    message = info.value.message
    assert "\n" not in message and len(message) <= 300
    assert "tensor 'buffer' differs between ranks 1 and 3" in message


def test_plain_copies_that_differ_are_one_error(tmp_path: Path) -> None:
    torch.save({"step": torch.tensor([4, 2])}, tmp_path / "model_world_size_2_rank_0.pt")
    torch.save({"step": torch.tensor([4, 3])}, tmp_path / "model_world_size_2_rank_1.pt")
    with pytest.raises(CheckpointError, match=r"'step' differs between ranks 0 and 1; it is saved"):
        full_tensors(plan_rank_files(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("folder", "named"),
    [
        ("partial", r"tensor 'summed' has placements \(Partial\(sum\), Shard\(0\)\)"),
        ("uneven", r"tensor 'uneven' .*_StridedShard\(dim=0, sf=2\) over 2 ranks .* uneven"),
    ],
)
def test_placements_not_modelled_are_refused_naming_the_tensor(
    mesh_root: Path, folder: str, named: str
) -> None:
    with pytest.raises(CheckpointError, match=named) as info:
        plan_rank_files(mesh_root / folder)
    assert "\n" not in info.value.message and len(info.value.message) <= 300
