from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.io.copy import (
    THREADS_ENV,
    CopyJob,
    copy_jobs,
    copy_range,
    copy_threads,
)


def _files(tmp_path: Path, n: int, size: int) -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(os.urandom(size))
        out.append(p)
    return out


@pytest.mark.parametrize("threads", [1, 4])
def test_copy_jobs_place_every_range(tmp_path: Path, threads: int) -> None:
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
        copy_jobs(jobs, copy_range, seen.append, threads=threads)
    finally:
        os.close(fd)
    data = dst.read_bytes()
    for i, (path, off, n) in enumerate(jobs_spec):
        start = (47 - i) * 4096
        assert data[start : start + n] == path.read_bytes()[off : off + n]
    assert seen == [4096] * 48


@pytest.mark.parametrize("threads", [1, 4])
def test_copy_jobs_raise_the_first_error(tmp_path: Path, threads: int) -> None:
    (src,) = _files(tmp_path, 1, 4096)
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        jobs = [CopyJob(tmp_path / "z-missing.bin", 0, fd, 4096, 10), CopyJob(src, 0, fd, 0, 4096)]
        seen: list[int] = []
        with pytest.raises(CheckpointError, match=r"z-missing\.bin: cannot read"):
            copy_jobs(jobs, copy_range, seen.append, threads=threads)
        assert seen == [4096]  # src.bin comes first in read order
    finally:
        os.close(fd)


def test_copy_jobs_read_each_file_front_to_back_and_stop_when_asked(tmp_path: Path) -> None:
    a, b = _files(tmp_path, 2, 4 * 4096)
    # the output wants b's blocks backwards, then a's: the copies read each file in order
    jobs = [CopyJob(b, (3 - i) * 4096, -1, i * 4096, 4096) for i in range(4)]
    jobs += [CopyJob(a, (3 - i) * 4096, -1, (4 + i) * 4096, 4096) for i in range(4)]
    calls: list[tuple[str, int]] = []

    def record(src: int, dst: int, src_off: int, dst_off: int, n: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{src}"), src_off))

    assert copy_jobs(jobs, record, threads=1)
    assert calls == [(str(p), k * 4096) for p in (a, b) for k in range(4)]
    calls.clear()
    assert not copy_jobs(jobs, record, stop=lambda: len(calls) == 3, threads=1)
    assert len(calls) == 3
    calls.clear()
    seen: list[int] = []
    assert not copy_jobs(jobs, record, seen.append, stop=lambda: len(calls) >= 3, threads=4)
    assert 3 <= len(calls) < 8  # the jobs not started when asked to stop never run
    assert len(seen) == len(calls)


def test_copy_threads_leave_a_core_and_keep_to_the_thread_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cores less one, at most 8 (a many-core node copies on 8 threads, not 4), within
    OMP_NUM_THREADS; SHARDFORGE_COPY_THREADS chooses (a hashed output's jobs too)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    for cores, threads in ((1, 1), (2, 1), (3, 2), (5, 4), (16, 8), (64, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda n=cores: n)
        assert copy_threads() == threads
    for share, threads in (("1", 1), ("2", 2), ("12", 8), ("0", 1), ("many", 8)):
        monkeypatch.setenv("OMP_NUM_THREADS", share)
        assert copy_threads() == threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for chosen, threads in (("12", 12), ("1", 1), ("0", 1), ("x", 1)):
        monkeypatch.setenv(THREADS_ENV, chosen)
        assert copy_threads() == threads  # not chosen ("0", "x"): OMP_NUM_THREADS's share


@pytest.mark.parametrize("threads", [1, 3])
def test_large_jobs_run_in_pieces_each_read_ahead_before_it_is_copied(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job longer than READ_PIECE runs as pieces; the source bytes of the pieces after the
    one starting are asked of the kernel (posix_fadvise WILLNEED, each once, in the order the
    pieces run, at most READ_PIECE per request) before they are copied."""
    import shardforge.io.copy as copy_module
    import shardforge.io.readahead as readahead

    monkeypatch.setattr(copy_module, "READ_PIECE", 5000)
    monkeypatch.setattr(readahead, "READ_AHEAD_PIECES", 2)
    a, b = _files(tmp_path, 2, 30000)
    asked: list[tuple[str, int, int]] = []
    copied: list[tuple[str, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, n: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
        real(fd, offset, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)

    def copy(src: int, dst: int, src_off: int, dst_off: int, n: int) -> None:
        path = os.readlink(f"/proc/self/fd/{src}")
        copied.append((path, src_off))
        assert (path, src_off, n) in asked  # read ahead before its copy
        copy_range(src, dst, src_off, dst_off, n)

    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        jobs = [CopyJob(b, 1000, fd, 0, 22000), CopyJob(a, 0, fd, 22000, 30000)]
        assert copy_jobs(jobs, copy, threads=threads)
    finally:
        os.close(fd)
    out = (tmp_path / "out.bin").read_bytes()
    assert out == b.read_bytes()[1000:23000] + a.read_bytes()
    want = [(str(a), at, min(5000, 30000 - at)) for at in range(0, 30000, 5000)]
    want += [(str(b), 1000 + at, min(5000, 22000 - at)) for at in range(0, 22000, 5000)]
    assert asked == want  # a first: read order; every piece once, none larger than a piece
    assert sorted(copied) == sorted((p, o) for p, o, _ in want)


def _hashed_copy(tmp_path: Path, jobs_spec: list[tuple[Path, int, int, int]], threads: int) -> str:
    """Copy (src, src_offset, dst_offset, n) jobs into a hashed output; its hash as written."""
    import blake3

    from shardforge.io.digest import FileHash, hashing

    size = max(d + n for _, _, d, n in jobs_spec)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    h = FileHash(path)
    try:
        os.ftruncate(fd, size)
        with hashing(fd, h):
            copy_jobs([CopyJob(p, o, fd, d, n) for p, o, d, n in jobs_spec], copy_range, None,
                      threads=threads)  # fmt: skip
    finally:
        os.close(fd)
    written = path.read_bytes()
    for src, off, dst, n in jobs_spec:
        assert written[dst : dst + n] == src.read_bytes()[off : off + n]
    assert h.hexdigest(size) == blake3.blake3(written).hexdigest()
    return h.hexdigest(size)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_hashed_output_is_hashed_as_the_copy_threads_write_it(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every piece copied tells the hash where it landed (jobs cut into pieces of 3000 bytes,
    the hash catching up every 1000); jobs after a gap leave the frontier at the gap until it
    is filled."""
    import shardforge.io.copy as copy_module
    import shardforge.io.digest as digest

    monkeypatch.setattr(copy_module, "READ_PIECE", 3000)
    monkeypatch.setattr(digest, "CHUNK", 1000)
    srcs = _files(tmp_path, 3, 1 << 16)
    contiguous = [(srcs[i % 3], (i // 3) * 4096, (47 - i) * 4096, 4096) for i in range(48)]
    _hashed_copy(tmp_path, contiguous, threads)
    gapped = [(srcs[0], 0, 4096, 40000), (srcs[1], 0, 0, 4096)]
    path = tmp_path / "g.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        from shardforge.io.digest import FileHash, hashing

        h = FileHash(path)
        with hashing(fd, h):
            copy_jobs([CopyJob(*gapped[0][:2], fd, *gapped[0][2:])], copy_range, threads=threads)
            assert h.frontier == 0 and h.hashed == 0  # the first 4096 bytes are not written
            copy_jobs([CopyJob(*gapped[1][:2], fd, *gapped[1][2:])], copy_range, threads=threads)
        assert h.frontier == 44096
        h.hexdigest(44096)
    finally:
        os.close(fd)


def test_a_hashed_copy_hashes_the_bytes_it_wrote_not_a_read_of_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35 (3): a source rewritten in place while it is copied must not give a manifest
    of other bytes than the output holds. Here the source changes just before the kernel
    copies it: the digest is the output's (the hash reads the output), whatever was read of
    the source before."""
    import blake3

    from shardforge.io.digest import FileHash, hashing

    (src,) = _files(tmp_path, 1, 1 << 16)
    real = os.copy_file_range

    def rewritten_first(fd_in: int, fd_out: int, count: int, *args: int) -> int:
        with src.open("r+b") as f:  # the source is rewritten in place now
            f.write(b"\xff" * (1 << 16))
        return real(fd_in, fd_out, count, *args)

    monkeypatch.setattr(os, "copy_file_range", rewritten_first)
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    h = FileHash(path)
    try:
        with hashing(fd, h):
            copy_jobs([CopyJob(src, 0, fd, 0, 1 << 16)], copy_range, threads=1)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\xff" * (1 << 16)
    assert h.hexdigest(1 << 16) == blake3.blake3(path.read_bytes()).hexdigest()
