"""Tensor sources: zero-copy slabs agree with reads; transformed sources are never zero-copy;
averages equal the fp32 mean and refuse inputs that differ."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardforge.errors import MergeError
from shardforge.formats.base import Destination
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.sources import (
    AveragedSource,
    TransformedSource,
    average,
)
from shardforge.io.copy import ReadCache


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, DcpSource]:
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=path, no_dist=True)
    return {k: DcpSource(e) for k, e in read_metadata(path).tensors.items()}


def _written(reader: ReadCache, src: object, dtype: torch.dtype, tmp: Path) -> torch.Tensor:
    """Write `src` through its own `write` into a file and read the bytes back."""
    assert hasattr(src, "shape")
    shape = src.shape  # type: ignore[attr-defined]
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        src.write(reader, Destination(fd, 8, dtype, lambda n: None))  # type: ignore[attr-defined]
        data = bytearray(os.pread(fd, nbytes, 8))
    finally:
        os.close(fd)
    return torch.frombuffer(data, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape)


def test_slabs_copy_and_read_agree(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ts = {"a": torch.randn(7, 5), "b": torch.randn(3).bfloat16(), "c": torch.tensor(2.5)}
    sources = _save(tmp_path / "ck", ts)
    with ReadCache() as reader:
        for k, t in ts.items():
            src = sources[k]
            assert src.slabs(reader) is not None  # contiguous single chunk: zero-copy
            assert torch.equal(src.read(reader), t)
            assert torch.equal(_written(reader, src, t.dtype, tmp_path / "o"), t)
            # a transformed source is read and transformed, never copied
            flipped = TransformedSource(src, lambda x: x.flip(0) if x.dim() else x)
            assert flipped.slabs(reader) is None
            want = t.flip(0) if t.dim() else t
            assert torch.equal(_written(reader, flipped, t.dtype, tmp_path / "o"), want)


def test_average_is_the_fp32_mean_cast_back(tmp_path: Path) -> None:
    torch.manual_seed(1)
    inputs = [
        {"w": torch.randn(6, 4).bfloat16(), "n": torch.arange(4), "x": torch.randn(5)}
        for _ in range(3)
    ]
    per = [_save(tmp_path / f"ck{i}", t) for i, t in enumerate(inputs)]
    avg = average(per, ["a", "b", "c"])
    with ReadCache() as reader:
        w = avg["w"]
        assert isinstance(w, AveragedSource) and w.slabs(reader) is None
        acc = torch.zeros(6, 4)
        for t in inputs:
            acc += t["w"].float()
        want = acc.div_(3)
        assert w.read(reader).dtype == torch.float32
        assert torch.equal(w.read(reader), want)
        assert torch.equal(_written(reader, w, torch.bfloat16, tmp_path / "o"), want.bfloat16())
        # integer buffers: the first input's values
        assert torch.equal(avg["n"].read(reader), inputs[0]["n"])


def test_average_lists_every_difference(tmp_path: Path) -> None:
    a = _save(tmp_path / "a", {"w": torch.zeros(2, 2), "v": torch.zeros(3)})
    b = _save(tmp_path / "b", {"w": torch.zeros(2, 2).half(), "u": torch.zeros(3)})
    with pytest.raises(MergeError) as exc:
        average([a, b], ["step 1", "step 2"])
    msg = str(exc.value)
    assert "step 2 lacks v" in msg and "step 2 has extra u" in msg
    assert "w: torch.float32 [2, 2] in step 1 vs torch.float16 [2, 2] in step 2" in msg


def test_a_cast_thread_reuses_its_buffers() -> None:
    """Each cast thread keeps one input and one output buffer and takes views of them (fresh
    blocks were kept by the allocator and grew the RSS); they grow only for a larger block."""
    from shardforge.formats.dcp.source import _Scratch

    scratch = _Scratch()
    inp, out = scratch.take(100, 50)
    first_in, first_out = scratch.inp, scratch.out.data_ptr()
    assert (len(inp), out.numel()) == (100, 50)
    inp, out = scratch.take(80, 40)
    assert scratch.inp is first_in and scratch.out.data_ptr() == first_out == out.data_ptr()
    assert (len(inp), out.numel()) == (80, 40)
    scratch.take(200, 10)
    assert len(scratch.inp) == 200 and scratch.inp is not first_in
    assert scratch.out.data_ptr() == first_out


def test_casts_go_through_memory_in_parallel_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cast of a stored slab, in many small blocks on the cast threads, equals `.to(dtype)`
    (and so does writing some rows only, as a distributed merge rank does)."""
    from shardforge.formats.dcp import source as mod

    monkeypatch.setattr(mod, "CAST_BLOCK", 64)  # 64-byte blocks: dozens of them, in parallel
    torch.manual_seed(1)
    ts = {"w": torch.randn(301, 7), "v": torch.randn(5)}
    srcs = _save(tmp_path / "ck", ts)
    with ReadCache() as reader:
        for dtype in (torch.bfloat16, torch.float16):
            for name, t in ts.items():
                got = _written(reader, srcs[name], dtype, tmp_path / "o")
                assert torch.equal(got, t.to(dtype)), (name, dtype)
        src, t = srcs["w"], ts["w"]
        fd = os.open(tmp_path / "rows", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, t.numel() * 2)
            done: list[int] = []
            src.write(reader, Destination(fd, 0, torch.bfloat16, done.append), (100, 250))
            data = bytearray(os.pread(fd, t.numel() * 2, 0))
        finally:
            os.close(fd)
        rows = torch.frombuffer(data, dtype=torch.bfloat16).reshape(t.shape)
        assert torch.equal(rows[100:250], t[100:250].bfloat16())
        assert not rows[:100].any() and not rows[250:].any()
        assert sum(done) == 150 * 7 * 2 and len(done) > 1  # in blocks, every byte reported
