from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.chunks import copy_range
from shardforge.io.copy import CopyJob, copy_jobs, prefetch


def _files(tmp_path: Path, n: int, size: int) -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(os.urandom(size))
        out.append(p)
    return out


@pytest.mark.parametrize("workers", [1, 4])
def test_copy_jobs_place_every_range(tmp_path: Path, workers: int) -> None:
    srcs = _files(tmp_path, 3, 1 << 16)
    # interleave ranges of the three files into one output, in reverse order of the sources
    jobs_spec = [(srcs[i % 3], (i // 3) * 4096, 4096) for i in range(48)]
    dst = tmp_path / "out.bin"
    fd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o644)
    seen: list[int] = []
    try:
        os.ftruncate(fd, 48 * 4096)
        jobs = [
            CopyJob(path, off, fd, (47 - i) * 4096, n) for i, (path, off, n) in enumerate(jobs_spec)
        ]
        copy_jobs(jobs, copy_range, seen.append, workers=workers)
    finally:
        os.close(fd)
    data = dst.read_bytes()
    for i, (path, off, n) in enumerate(jobs_spec):
        start = (47 - i) * 4096
        assert data[start : start + n] == path.read_bytes()[off : off + n]
    assert seen == [4096] * 48


def test_copy_jobs_raise_the_first_error(tmp_path: Path) -> None:
    (src,) = _files(tmp_path, 1, 4096)
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        jobs = [CopyJob(src, 0, fd, 0, 4096), CopyJob(tmp_path / "missing.bin", 0, fd, 0, 10)]
        with pytest.raises(CheckpointError, match=r"missing\.bin: cannot read"):
            copy_jobs(jobs, copy_range, workers=4)
    finally:
        os.close(fd)


def test_prefetch_respects_its_budget(tmp_path: Path) -> None:
    files = _files(tmp_path, 3, 10_000)
    assert prefetch(files, budget=25_000) == 25_000
    assert prefetch(files, budget=10**9) == 30_000
    assert prefetch([tmp_path / "missing"], budget=100) == 0
