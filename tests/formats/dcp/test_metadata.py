"""Reading DCP metadata and chunks: uneven sharding (zero-size chunks), replicated tensors,
column sharding, strided chunks, older pickles, and the refusals."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from helpers.dist import run_on_ranks
from shardforge.errors import CheckpointError
from shardforge.formats.dcp.chunks import locate, read_full
from shardforge.formats.dcp.metadata import Chunk, read_metadata
from shardforge.formats.dcp.source import DcpSource
from shardforge.io.copy import ReadCache
from shardforge.sinks.plan import TensorSpec, plan_output
from shardforge.sinks.safetensors_files import write_plan


def originals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(2, 5, generator=g),  # 2 rows over 3 ranks: one chunk is empty
        "cols": torch.randn(4, 7, generator=g).to(torch.bfloat16),  # sharded along dim 1
        "replicated": torch.randn(3, 3, generator=g),  # a plain tensor on every rank
        "ids": torch.arange(11, dtype=torch.int64),  # 11 over 3 ranks
        "scalar": torch.tensor(3.5),
    }


def save_sharded(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    t = originals()
    sd = {
        "rows": distribute_tensor(t["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(t["cols"], mesh, [Shard(1)]),
        "replicated": t["replicated"],
        "ids": distribute_tensor(t["ids"], mesh, [Shard(0)]),
        "scalar": t["scalar"],
        "step": 7,  # a non-tensor entry
    }
    dcp.save(sd, checkpoint_id=out)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_on_ranks(save_sharded, 3, str(out))
    return out


@pytest.mark.slow
def test_reads_every_kind_of_chunk(sharded: Path) -> None:
    meta = read_metadata(sharded)
    assert meta.non_tensor_keys == ("step",)
    assert [c.sizes for c in meta.tensors["rows"].chunks] == [(1, 5), (1, 5), (0, 5)]
    assert [c.offsets for c in meta.tensors["cols"].chunks] == [(0, 0), (0, 3), (0, 6)]
    # replicated tensors are stored once, by whichever rank (here not rank 0)
    (rep,) = meta.tensors["replicated"].chunks
    (scalar,) = meta.tensors["scalar"].chunks
    assert {rep.file.name, scalar.file.name} != {"__0_0.distcp"}
    with ReadCache() as reader:
        for key, ref in originals().items():
            got = read_full(reader, meta.tensors[key])
            assert got.dtype == ref.dtype and torch.equal(got, ref), key


@pytest.mark.slow
def test_streams_every_kind_of_chunk_into_safetensors(sharded: Path, tmp_path: Path) -> None:
    """Slabs are copied, column shards assembled, a cast applied; safetensors reads it back."""
    from safetensors.torch import load_file

    meta = read_metadata(sharded)
    specs = [TensorSpec(k, e.dtype, e.shape) for k, e in meta.tensors.items()]
    specs[0] = TensorSpec("rows", torch.float16, meta.tensors["rows"].shape)  # cast while streaming
    plan = plan_output(specs, "5GB", 0)
    write_plan(plan, {k: DcpSource(v) for k, v in meta.tensors.items()}, tmp_path, lambda n: None)
    got = load_file(tmp_path / "model.safetensors")
    for key, ref in originals().items():
        want = ref.to(torch.float16) if key == "rows" else ref
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key


def test_strided_chunk_is_read_with_its_stride(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    t = torch.randn(4, 6).t()  # non-contiguous
    dcp.save({"t": t}, checkpoint_id=tmp_path / "c", no_dist=True)
    meta = read_metadata(tmp_path / "c")
    with ReadCache() as reader:
        _, raw = locate(reader, meta.tensors["t"].chunks[0])
        assert raw is not None and not raw.contiguous
        assert torch.equal(read_full(reader, meta.tensors["t"]), t)


def _rewrite(directory: Path, edit: object, protocol: int = 4) -> None:
    path = directory / ".metadata"
    with path.open("rb") as f:
        meta = pickle.load(f)  # our own test file
    edit(meta)  # type: ignore[operator]
    path.write_bytes(pickle.dumps(meta, protocol=protocol))


@pytest.mark.slow
def test_older_pickles_without_new_fields_and_old_module_paths(
    sharded: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "old"
    shutil.copytree(sharded, ckpt)

    def drop_new_fields(meta: object) -> None:
        meta.__dict__.pop("storage_meta", None)
        meta.__dict__.pop("version", None)

    _rewrite(ckpt, drop_new_fields, protocol=2)
    data = (ckpt / ".metadata").read_bytes()
    # where torch 2.2 kept these classes
    moved = {
        b"ctorch.distributed.checkpoint.metadata\nTensorProperties\n": (
            b"ctorch.distributed._shard.sharded_tensor.metadata\nTensorProperties\n"
        ),
        b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n": (
            b"ctorch.distributed._shard.sharded_tensor.metadata\nMEM_FORMAT_ENCODING\n"
        ),
    }
    for now, then in moved.items():
        assert now in data
        data = data.replace(now, then)
    (ckpt / ".metadata").write_bytes(data)
    meta = read_metadata(ckpt)
    with ReadCache() as reader:
        assert torch.equal(read_full(reader, meta.tensors["rows"]), originals()["rows"])


@pytest.mark.slow
def test_compressed_items_are_refused(sharded: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "z"
    shutil.copytree(sharded, ckpt)

    def compress(meta: object) -> None:
        for info in meta.storage_data.values():  # type: ignore[attr-defined]
            info.transform_descriptors = ["stream.zstd/1"]

    _rewrite(ckpt, compress)
    with pytest.raises(CheckpointError, match="compression"):
        read_metadata(ckpt)


def test_safetensors_format_distcp_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    writer = FileSystemWriter(tmp_path / "s", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"a": torch.ones(3)}, storage_writer=writer, no_dist=True)
    with pytest.raises(CheckpointError, match="safetensors format"):
        read_metadata(tmp_path / "s")


@pytest.mark.slow
def test_incomplete_tiling_is_refused(sharded: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "holes"
    shutil.copytree(sharded, ckpt)

    def drop_chunk(meta: object) -> None:
        meta.state_dict_metadata["ids"].chunks.pop(0)  # type: ignore[attr-defined]

    _rewrite(ckpt, drop_chunk)
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        read_metadata(ckpt)


@pytest.mark.slow
def test_missing_data_file_is_refused(sharded: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "gone"
    shutil.copytree(sharded, ckpt)
    (ckpt / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp.*missing"):
        read_metadata(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/etc/passwd", "../x.distcp", "a/../../x.distcp"])
def test_storage_paths_leaving_the_directory_are_refused(
    sharded: Path, tmp_path: Path, path: str
) -> None:
    ckpt = tmp_path / "escape"
    shutil.copytree(sharded, ckpt)

    def escape(meta: object) -> None:
        next(iter(meta.storage_data.values())).relative_path = path  # type: ignore[attr-defined]

    _rewrite(ckpt, escape)
    with pytest.raises(CheckpointError, match="leaves the checkpoint directory"):
        read_metadata(ckpt)


def _grid(rows: int, cols: int, block: int) -> list[Chunk]:
    f = Path("f")
    return [
        Chunk((r * block, c * block), (block, block), f, 0, 1)
        for r in range(rows)
        for c in range(cols)
    ]


def test_tiling_is_exact_and_quick_for_many_chunks() -> None:
    """Thousands of chunks are checked in a sweep along dim 0 (not every pair); an overlap
    between chunks that are not neighbours in any order, a gap, and a chunk outside are found."""
    import time

    from shardforge.formats.dcp.metadata import check_tiling

    where = Path("m")
    start = time.perf_counter()
    rows = [Chunk((i, 0), (1, 8), Path("f"), 0, 1) for i in range(8192)]
    check_tiling("rows", (8192, 8), rows[::-1], where)  # every pair: 33 million checks
    check_tiling("grid", (32 * 4, 32 * 4), _grid(32, 32, 4), where)
    assert time.perf_counter() - start < 5.0
    grid = _grid(8, 8, 4)
    grid[63] = Chunk((1, 2), (4, 4), Path("f"), 0, 1)  # the last block moved onto the first ones
    with pytest.raises(CheckpointError, match="overlap"):
        check_tiling("grid", (32, 32), grid, where)
    with pytest.raises(CheckpointError, match="cover 1008 of 1024 elements"):
        check_tiling("grid", (32, 32), _grid(8, 8, 4)[:-1], where)
    with pytest.raises(CheckpointError, match="lies outside its shape"):
        check_tiling("grid", (32, 31), _grid(8, 8, 4), where)
    with pytest.raises(CheckpointError, match="negative dimension"):
        check_tiling("t", (-1, 4), [], where)
