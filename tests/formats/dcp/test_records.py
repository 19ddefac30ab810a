"""Locating a chunk's raw bytes inside its stored torch.save record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.formats.dcp.records import locate, read_chunk


def _save(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=tmp_path / "c", no_dist=True)
    return tmp_path / "c"


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
)
def test_raw_offset_points_at_the_elements(tmp_path: Path, dtype: torch.dtype) -> None:
    import os

    t = (torch.arange(30) % 7).to(dtype).view(5, 6)
    meta = read_metadata(_save(tmp_path, {"t": t}))
    (chunk,) = meta.tensors["t"].chunks
    fd = os.open(chunk.file, os.O_RDONLY)
    try:
        raw = locate(chunk, fd)
        assert raw is not None and raw.contiguous and raw.dtype == dtype
        data = os.pread(fd, raw.nbytes, raw.data_offset)
        assert data == t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert torch.equal(read_chunk(chunk, fd, raw), t)
    finally:
        os.close(fd)


def test_damaged_record_names_the_file(tmp_path: Path) -> None:
    import os

    ckpt = _save(tmp_path, {"t": torch.ones(100)})
    meta = read_metadata(ckpt)
    (chunk,) = meta.tensors["t"].chunks
    data = bytearray(chunk.file.read_bytes())
    data[chunk.byte_offset + chunk.byte_length - 22 : chunk.byte_offset + chunk.byte_length] = (
        b"\0" * 22
    )  # wipe the end-of-central-directory record
    chunk.file.write_bytes(bytes(data))
    fd = os.open(chunk.file, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp.*damaged"):
            locate(chunk, fd)
    finally:
        os.close(fd)
