"""`io.direct`: an output file's bytes gathered in aligned windows, hashed from memory and
written with O_DIRECT, on a real file system (the test's temporary folder), from many threads
in any order; what cannot be completed in memory goes through the page cache, still right."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import mmap
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

import shardforge.io.digest as digest
import shardforge.io.direct as direct
from shardforge.errors import CheckpointError, MergeError
from shardforge.io.copy import CopyJob, copy_jobs, copy_range, pwrite_all
from shardforge.io.digest import FileHash
from shardforge.io.direct import direct_of, writes_to

SIZE = 200_003  # not a whole number of pages: the last page goes through the page cache
DATA = os.urandom(SIZE)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 3 pages, at most 3 of them: every path taken on 200 KB."""
    monkeypatch.setattr(direct, "WINDOW", 3 * 4096)
    monkeypatch.setattr(direct, "MAX_WINDOWS", 3)
    monkeypatch.delenv(direct.ENV, raising=False)


def cuts(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    bounds = [0, *sorted(rng.sample(range(1, SIZE), n - 1)), SIZE]
    return list(itertools.pairwise(bounds))


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def in_page_cache(path: Path, offset: int, n: int) -> bool:
    """Whether any page of [offset, offset + n) of the file is in the page cache: mincore(2)
    of a mapping of it (mapping reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        vec = (ctypes.c_ubyte * ((n + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        assert libc.mincore(addr, n, vec) == 0, os.strerror(ctypes.get_errno())
        return any(v & 1 for v in vec)
    finally:
        libc.munmap(addr, n)


def new_output(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.posix_fallocate(fd, 0, SIZE)
    return fd


def want(algo: str) -> str:
    return (blake3.blake3 if algo == "blake3" else hashlib.sha256)(DATA).hexdigest()


@pytest.fixture
def out(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "out.bin"
    fd = new_output(path)
    yield path, fd
    os.close(fd)


@pytest.mark.parametrize("algo", ["blake3", "sha256", None])
def test_pieces_from_many_threads_in_any_order(out: tuple[Path, int], algo: str | None) -> None:
    path, fd = out
    h = FileHash(path, algo) if algo else None
    parts = cuts(60, seed=1)
    random.Random(2).shuffle(parts)
    with writes_to(fd, SIZE, h):
        d = direct_of(fd)
        assert d is not None

        def write(mine: list[tuple[int, int]]) -> None:
            for a, b in mine:
                pwrite_all(fd, memoryview(DATA[a:b]), a)

        threads = [threading.Thread(target=write, args=(parts[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert d._buffers <= direct.MAX_WINDOWS
    assert path.read_bytes() == DATA
    if h is not None:
        assert h.hexdigest(SIZE) == want(algo or "")


def test_in_order_bytes_never_enter_the_page_cache_nor_are_read_back(
    out: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written in the file's order, every window is hashed from memory (no read-back of the
    file) and its whole pages written with O_DIRECT (not in the output's page cache after)."""
    path, fd = out
    read_back: list[int] = []
    real = digest._hash_fd

    def counted(h: object, f: int, a: int, b: int) -> None:
        read_back.append(b - a)
        real(h, f, a, b)

    monkeypatch.setattr(digest, "_hash_fd", counted)
    h = FileHash(path, "blake3")
    with writes_to(fd, SIZE, h):
        for a, b in cuts(40, seed=3):
            pwrite_all(fd, memoryview(DATA[a:b]), a)
    whole = SIZE - SIZE % 4096
    assert not in_page_cache(path, 0, whole)
    assert in_page_cache(path, whole, SIZE - whole)  # (the last partial page: it was)
    assert h.hexdigest(SIZE) == want("blake3")
    assert read_back == []
    assert path.read_bytes() == DATA


def test_a_cold_input_at_odd_offsets(tmp_path: Path, out: tuple[Path, int]) -> None:
    """Slabs of an input not in the page cache, at offsets of no alignment, copied on three
    threads: the bytes land where they belong and the digest is theirs."""
    path, fd = out
    src = tmp_path / "input.bin"
    src.write_bytes(b"x" * 777 + DATA + b"y" * 5000)
    evict(src)
    h = FileHash(path, "sha256")
    with writes_to(fd, SIZE, h):
        jobs = [CopyJob(src, 777 + a, fd, a, b - a) for a, b in cuts(25, seed=4)]
        copy_jobs(jobs, copy_range, threads=3)
    assert h.hexdigest(SIZE) == want("sha256")
    assert path.read_bytes() == DATA


@pytest.mark.parametrize("cold", [False, True])
def test_an_input_shorter_than_its_slab_is_an_error(
    tmp_path: Path, out: tuple[Path, int], cold: bool
) -> None:
    _, fd = out
    src = tmp_path / "short.bin"
    src.write_bytes(DATA[:50_000])
    if cold:
        evict(src)
    sfd = os.open(src, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="short read"), writes_to(fd, SIZE, None):
            copy_range(sfd, fd, 10_000, 0, 60_000)
    finally:
        os.close(sfd)


def test_a_file_completed_later_goes_through_the_page_cache(out: tuple[Path, int]) -> None:
    """The early copy writes some tensors, the merge the rest, each in its own block (as
    `merge.overlap` and `sinks.safetensors_files.finish_plan` do): the windows the first left
    unfinished cannot complete in memory; the bytes and the digest are still right."""
    path, fd = out
    h = FileHash(path, "blake3")
    parts = cuts(30, seed=5)
    first, rest = parts[::3], [p for i, p in enumerate(parts) if i % 3]
    for mine in (first, rest):
        with writes_to(fd, SIZE, h):
            for a, b in mine:
                pwrite_all(fd, memoryview(DATA[a:b]), a)
    assert h.hexdigest(SIZE) == want("blake3")
    assert path.read_bytes() == DATA


def test_turned_off_writes_straight_to_the_file(
    out: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, fd = out
    monkeypatch.setenv(direct.ENV, "0")
    h = FileHash(path, "blake3")
    with writes_to(fd, SIZE, h):
        assert direct_of(fd) is None
        pwrite_all(fd, memoryview(DATA), 0)
    assert h.hexdigest(SIZE) == want("blake3")
    assert path.read_bytes() == DATA


def _failing_odirect_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    """os.pwrite fails with `code` on every O_DIRECT descriptor (a stand-in for a file
    system that refuses, or a disk that fails); the calls refused, counted."""
    refused: list[int] = []
    real = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    return refused


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_refused_odirect_write_falls_back_to_the_page_cache(
    out: tuple[Path, int], monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path, fd = out
    refused = _failing_odirect_writes(monkeypatch, code)
    h = FileHash(path, "blake3")
    with writes_to(fd, SIZE, h):
        pwrite_all(fd, memoryview(DATA), 0)
    assert 1 <= len(refused) <= direct.WRITERS  # (those in flight), then the page cache
    assert h.hexdigest(SIZE) == want("blake3")
    assert path.read_bytes() == DATA


def test_a_failed_write_reaches_the_writer(
    out: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fd = out
    _failing_odirect_writes(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output"), writes_to(fd, SIZE, None):
        for a, b in cuts(20, seed=6):
            pwrite_all(fd, memoryview(DATA[a:b]), a)
    assert direct_of(fd) is None


def test_a_writer_waiting_for_a_buffer_gets_an_error_when_the_file_is_discarded(
    out: tuple[Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One buffer, held by a window whose O_DIRECT write is stalled; a second writer waits for
    it; the file is discarded (an interrupt in the main thread): the waiting writer (a cast
    thread the interrupt left running) gets an error instead of waiting forever."""
    import fcntl

    _, fd = out
    monkeypatch.setattr(direct, "MAX_WINDOWS", 1)
    stalled = threading.Event()
    real = os.pwrite

    def pwrite(f: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(f, fcntl.F_GETFL) & os.O_DIRECT:
            stalled.wait(10)
        return real(f, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    w = direct.WINDOW
    errors: list[Exception] = []

    def second() -> None:
        try:
            pwrite_all(fd, memoryview(DATA[w : 2 * w]), w)
        except MergeError as exc:
            errors.append(exc)
        finally:
            stalled.set()

    waiter = threading.Thread(target=second)
    with pytest.raises(KeyboardInterrupt), writes_to(fd, SIZE, None):
        pwrite_all(fd, memoryview(DATA[:w]), 0)  # window 0 complete: its write stalls
        waiter.start()
        time.sleep(0.2)  # (it waits for the buffer; the outcome is the same if not yet)
        raise KeyboardInterrupt
    waiter.join(10)
    assert not waiter.is_alive()
    assert errors and "discarded" in str(errors[0])


def test_a_short_input_on_several_threads_fails_the_copy_without_a_hang(
    tmp_path: Path, out: tuple[Path, int]
) -> None:
    """One slab's input ends early while other threads copy: the copy raises (no window waits
    for bytes that never come), and nothing of the short slab is counted as written."""
    _, fd = out
    src = tmp_path / "input.bin"
    src.write_bytes(DATA)
    short = tmp_path / "short.bin"
    short.write_bytes(DATA[:1000])
    parts = cuts(30, seed=8)
    jobs = [CopyJob(short if i == 7 else src, a, fd, a, b - a) for i, (a, b) in enumerate(parts)]
    with pytest.raises(CheckpointError, match=r"short\.bin"), writes_to(fd, SIZE, None):
        copy_jobs(jobs, copy_range, threads=3)
    assert direct_of(fd) is None


class FailingHash:
    """A stand-in for a `FileHash` whose hashing fails (a read error of its own file, say):
    the same three members `io.direct` uses."""

    frontier = 0

    def absorb(self, offset: int, view: memoryview) -> bool:
        raise OSError(errno.EIO, "the hash failed")

    def written(self, offset: int, n: int) -> None:
        raise AssertionError("not reached")


def test_a_failing_hash_fails_every_writer_without_a_hang(out: tuple[Path, int]) -> None:
    _, fd = out
    failing: Any = FailingHash()
    with pytest.raises(OSError, match="the hash failed"), writes_to(fd, SIZE, failing):
        for a, b in cuts(40, seed=9):
            pwrite_all(fd, memoryview(DATA[a:b]), a)
    assert direct_of(fd) is None
