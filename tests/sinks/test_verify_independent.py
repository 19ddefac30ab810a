"""--verify reads the checkpoint by another path than the write: a wrong locate in the write
(a tensor's bytes taken from its neighbour's record) is written, and verification catches it,
naming the tensor. DCP through torch's DCP reader, per-rank DTensor files through
``torch.load(weights_only=True, mmap=True)``, averaged and reordered tensors recomputed, the
torch-file output read back by ``torch.load``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.dist import run_on_ranks
from shardforge.errors import MergeError
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.rankfiles.source import RankFileSource
from shardforge.formats.sources import (
    AveragedSource,
    TensorSource,
    TransformedSource,
)
from shardforge.sinks.plan import TensorSpec, plan_output
from shardforge.sinks.safetensors_files import write_plan
from shardforge.sinks.torch_file import verify_torch_file, write_torch_file
from shardforge.sinks.verify import verify_output


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(9, 5, generator=g),
        "b": torch.randn(9, 5, generator=g),  # same shape as "a": its neighbour
        "c": torch.randn(6, 7, generator=g),
        "n": torch.arange(4),
    }


def _write_and_verify(
    root: Path, sources: dict[str, TensorSource], write: dict[str, TensorSource] | None = None
) -> int:
    """Write `write` (default: `sources`) with the real writer, verify against `sources`."""
    specs = [TensorSpec(k, s.dtype, s.shape) for k, s in sources.items()]
    plan = plan_output(specs, "5GB", 0)
    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    write_plan(plan, write or sources, out, lambda n: None)
    return verify_output(plan, sources, out)


def _dcp(tmp_path: Path, name: str, seed: int) -> dict[str, DcpSource]:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / name
    dcp.save(_full(seed), checkpoint_id=directory, no_dist=True)
    meta = read_metadata(directory)
    return {k: DcpSource(e, meta.directory) for k, e in meta.tensors.items()}


def test_dcp_wrong_locate_is_caught(tmp_path: Path) -> None:
    sources = _dcp(tmp_path, "ckpt", 0)
    assert _write_and_verify(tmp_path, dict(sources)) == 4
    a, b = sources["a"], sources["b"]
    wrong: dict[str, TensorSource] = {
        **sources,
        "a": replace(a, entry=replace(a.entry, chunks=b.entry.chunks)),
    }
    with pytest.raises(MergeError) as err:
        _write_and_verify(tmp_path / "wrong", dict(sources), write=wrong)
    assert str(err.value).startswith("verification failed: a in ")
    assert "differs from the checkpoint" in str(err.value)


def test_averaged_and_reordered_tensors_are_recomputed(tmp_path: Path) -> None:
    one, two = _dcp(tmp_path, "one", 0), _dcp(tmp_path, "two", 1)
    averaged: dict[str, TensorSource] = {k: AveragedSource((one[k], two[k])) for k in one}
    assert _write_and_verify(tmp_path / "avg", averaged) == 4
    flip: dict[str, TensorSource] = {
        k: TransformedSource(s, lambda t: t.flip(0)) for k, s in one.items()
    }
    assert _write_and_verify(tmp_path / "flip", flip) == 4
    swapped = {**flip, "c": TransformedSource(one["c"], lambda t: t)}  # reordered wrongly
    with pytest.raises(MergeError, match="verification failed: c in "):
        _write_and_verify(tmp_path / "bad", flip, write=swapped)


def test_torch_file_wrong_locate_is_caught(tmp_path: Path) -> None:
    sources = _dcp(tmp_path, "ckpt", 0)
    specs = [TensorSpec(k, s.dtype, s.shape) for k, s in sources.items()]
    good = tmp_path / "good.pt"
    write_torch_file(specs, sources, good, lambda n: None)
    assert verify_torch_file(specs, sources, good) == 4
    a, b = sources["a"], sources["b"]
    wrong = {**sources, "b": replace(b, entry=replace(b.entry, chunks=a.entry.chunks))}
    bad = tmp_path / "bad.pt"
    write_torch_file(specs, wrong, bad, lambda n: None)
    with pytest.raises(MergeError, match=r"verification failed: b in .*bad\.pt differs"):
        verify_torch_file(specs, sources, bad)
    with pytest.raises(MergeError, match="verification failed: x in the output is missing"):
        verify_torch_file(specs, {**sources, "x": sources["c"]}, good)


def save_rank_files(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _full(0)
    state = {
        "a": distribute_tensor(full["a"], mesh, [Shard(0)]),  # 9 rows over 2 ranks: 5 + 4
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "c": distribute_tensor(full["c"], mesh, [Shard(1)]),  # assembled in memory
        "r": distribute_tensor(full["c"], mesh, [Replicate()]),
        "n": full["n"],  # a plain tensor on every rank
    }
    torch.save(state, f"{out}/model_world_size_{world_size}_rank_{rank}.pt")


@pytest.fixture(scope="module")
def rank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    run_on_ranks(save_rank_files, 2, str(out))
    return out


@pytest.mark.slow
def test_rank_files_wrong_locate_is_caught(rank_dir: Path, tmp_path: Path) -> None:
    from shardforge.formats.rankfiles import plan_rank_files

    plans = plan_rank_files(rank_dir)
    sources: dict[str, TensorSource] = {k: RankFileSource(p) for k, p in plans.items()}
    assert _write_and_verify(tmp_path, sources) == 5
    wrong: dict[str, TensorSource] = {
        **sources,
        "a": RankFileSource(replace(plans["a"], pieces=plans["b"].pieces)),
    }
    with pytest.raises(MergeError) as err:
        _write_and_verify(tmp_path / "wrong", sources, write=wrong)
    assert str(err.value).startswith("verification failed: a in ")
