"""--verify compares every written byte with the checkpoint: a flipped byte is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardforge.checkpoint.metadata import TensorEntry, read_metadata
from shardforge.checkpoint.plan import OutputPlan, TensorSpec, plan_output
from shardforge.checkpoint.stream import write_plan
from shardforge.checkpoint.verify import verify_output
from shardforge.errors import MergeError


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, OutputPlan, dict[str, TensorEntry]]:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g)}
    dcp.save(sd, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    meta = read_metadata(tmp_path / "ckpt")
    plan = plan_output([TensorSpec(k, e.dtype, e.shape) for k, e in meta.tensors.items()], "5GB", 0)
    out = tmp_path / "out"
    out.mkdir()
    write_plan(plan, dict(meta.tensors), out, lambda n: None)
    return out, plan, dict(meta.tensors)


def test_identical_output_passes(written: tuple[Path, OutputPlan, dict[str, TensorEntry]]) -> None:
    out, plan, sources = written
    assert verify_output(plan, sources, out) == 2


@pytest.mark.parametrize("where", [-1, -200])
def test_a_flipped_byte_is_caught(
    written: tuple[Path, OutputPlan, dict[str, TensorEntry]], where: int
) -> None:
    out, plan, sources = written
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(MergeError, match="verification failed"):
        verify_output(plan, sources, out)


def test_small_blocks_compare_the_same(
    written: tuple[Path, OutputPlan, dict[str, TensorEntry]],
) -> None:
    """Comparing in blocks of a few rows covers every row (a late byte flip is still caught)."""
    out, plan, sources = written
    small = 200  # 1 row of 33 floats per block
    assert verify_output(plan, sources, out, block_bytes=small) == 2
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-(7 * 4) - 5] ^= 0x80  # inside the last rows of "a"
    path.write_bytes(bytes(data))
    with pytest.raises(MergeError, match="verification failed: a"):
        verify_output(plan, sources, out, block_bytes=small)
