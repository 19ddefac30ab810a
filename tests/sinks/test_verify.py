"""--verify compares every written byte with the checkpoint read by torch's own DCP reader: a
flipped byte, an extra or missing tensor, a damaged record (CRC-32) are caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardforge.errors import MergeError
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.sources import TensorSource
from shardforge.sinks.plan import OutputPlan, TensorSpec, plan_output
from shardforge.sinks.safetensors_files import write_plan
from shardforge.sinks.verify import verify_output

Written = tuple[Path, OutputPlan, dict[str, TensorSource]]


def _sources(ckpt: Path) -> dict[str, TensorSource]:
    meta = read_metadata(ckpt)
    return {k: DcpSource(e, meta.directory) for k, e in meta.tensors.items()}


@pytest.fixture
def written(tmp_path: Path) -> Written:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g)}
    dcp.save(sd, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    sources = _sources(tmp_path / "ckpt")
    plan = plan_output([TensorSpec(k, s.dtype, s.shape) for k, s in sources.items()], "5GB", 0)
    out = tmp_path / "out"
    out.mkdir()
    write_plan(plan, sources, out, lambda n: None)
    return out, plan, sources


def test_identical_output_passes(written: Written) -> None:
    out, plan, sources = written
    assert verify_output(plan, sources, out) == 2


@pytest.mark.parametrize("where", [-1, -200])
def test_a_flipped_byte_is_caught(written: Written, where: int) -> None:
    out, plan, sources = written
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(MergeError, match=r"verification failed: [ab] in .* differs"):
        verify_output(plan, sources, out)


def test_small_blocks_compare_the_same(written: Written) -> None:
    """Comparing in blocks of a few rows covers every row (a late byte flip is still caught)."""
    out, plan, sources = written
    small = 200  # 1 row of 33 floats per block
    assert verify_output(plan, sources, out, block_bytes=small, batch_bytes=small) == 2
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-(7 * 4) - 5] ^= 0x80  # inside the last rows of "a"
    path.write_bytes(bytes(data))
    with pytest.raises(MergeError, match=r"verification failed: a in .*rows 63 to 63"):
        verify_output(plan, sources, out, block_bytes=small)


def test_an_extra_or_missing_tensor_is_an_error(written: Written) -> None:
    from safetensors.torch import save_file

    out, plan, sources = written
    extra = torch.zeros(3)
    save_file({"c": extra}, str(out / "extra.safetensors"))
    index = {"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}}
    index["weight_map"]["c"] = "extra.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MergeError, match=r"verification failed: c in .* not a tensor of the"):
        verify_output(plan, sources, out)
    del index["weight_map"]["c"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "extra.safetensors").unlink()
    with_more = {**sources, "d": sources["b"]}
    with pytest.raises(MergeError, match="verification failed: d in the output is missing"):
        verify_output(plan, with_more, out)


def test_a_damaged_record_fails_its_crc(tmp_path: Path) -> None:
    """A flipped byte in a stored tensor is copied by the write and read alike by torch: only
    the record's CRC-32 tells."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=tmp_path / "c")
    sources = _sources(tmp_path / "c")
    (data_file,) = (tmp_path / "c").glob("*.distcp")
    chunk = read_metadata(tmp_path / "c").tensors["w"].chunks[0]
    raw = bytearray(data_file.read_bytes())
    raw[chunk.byte_offset + chunk.byte_length // 2] ^= 0x10  # inside the tensor's bytes
    data_file.write_bytes(bytes(raw))
    plan = plan_output([TensorSpec("w", torch.float32, (4096,))], "5GB", 0)
    out = tmp_path / "out"
    out.mkdir()
    write_plan(plan, sources, out, lambda n: None)
    with pytest.raises(MergeError, match=r"verification failed: .*CRC-32"):
        verify_output(plan, sources, out)


def test_a_stored_tensor_shared_by_several_outputs_is_read_once_per_batch(
    written: Written,
) -> None:
    """The experts cut from one fused tensor share it: one batch reads it once."""
    from shardforge.keymap.conversion import Slice
    from shardforge.keymap.converted import SharedValue, SliceSource
    from shardforge.sinks.verify import _batches, _Check

    _, _, sources = written
    fused = sources["a"]
    halves = [
        SliceSource(fused, Slice("a", (r, 0), (32, 33), (32, 33)), SharedValue(2)) for r in (0, 32)
    ]
    checks = [_Check(f"a{i}", s, torch.float32, f"a{i}") for i, s in enumerate(halves)]
    assert [len(b) for b in _batches(checks, fused.stored()[0].nbytes)] == [2]
    assert [len(b) for b in _batches(checks, fused.stored()[0].nbytes - 1)] == [1, 1]
