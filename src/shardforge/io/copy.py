"""The byte path: one read cache, file-to-file copies, read-ahead and parallel copy jobs.

- `ReadCache`: the open data files of a merge (a bounded number of descriptors, regular files
  only) and the facts parsed from them (a record's layout, a `.metadata`), kept per file
  identity (device, inode, size, modification time) for the whole process, so that the head
  start, the merge and every reader parse each record and each `.metadata` once.
- `copy_range`, `pwrite_all`, `pwrite_then_hash`, `tensor_bytes`, `FileSlab`: bytes file to
  file in the kernel (`copy_file_range`) or through a bounded buffer; positional writes.

- `copy_jobs`: run many `copy_file_range` copies in the order of their source bytes (each data
  file read front to back, as `cp` reads it), on `copy_threads()` threads: the cores less one
  (one core is left to the start-up the copy overlaps: on a 2-core machine 4 threads slowed it
  more than they sped up the copy, benchmarks/README.md, "Session F: the byte-path profile"),
  at most `MAX_COPY_THREADS`, `SHARDFORGE_COPY_THREADS` to choose. The copies happen in the
  kernel, the GIL released, so the merge goes on importing and checking meanwhile; no tensor
  bytes pass through Python. Into an output file whose hash the manifest lists
  (`io.digest.hashing`), the jobs run in the order of their output bytes instead, so that the
  hash, which reads the written bytes back on a thread of its own, follows the copy closely;
  every write tells the hash where it landed (`FileHash.written`), nothing else.
- Into an output registered with `io.direct.writes_to` (a local safetensors file), every
  `copy_range` and `pwrite_all` hands its bytes to that file's `DirectOutput` instead, which
  gathers, hashes and writes them with O_DIRECT; its jobs run in the order of their output
  bytes (its inputs read from the page cache, asked ahead as for any copy).
- Read-ahead: jobs are cut into `pieces` of at most `READ_PIECE` bytes, each asked of the
  kernel ahead of its copy (`io.readahead.ReadAhead`).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from shardforge.errors import CheckpointError
from shardforge.io.digest import hash_of
from shardforge.io.direct import direct_of, pwrite_whole
from shardforge.io.dtypes import torch_ready
from shardforge.io.files import open_regular
from shardforge.io.readahead import ReadAhead, read_ahead_depth
from shardforge.io.remote import remote_of, remote_of_path

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# copy threads: at most this many, on the cores less one (`copy_threads`)
MAX_COPY_THREADS = 8
THREADS_ENV = "SHARDFORGE_COPY_THREADS"  # the copy threads, chosen (a positive integer)
# a copy job's largest piece, and one read-ahead request: several MB per request
READ_PIECE = 8 << 20
# one copy_file_range call (or one bounded read + write where it is unsupported) moves at most this
COPY_BLOCK = 64 << 20


@dataclass(frozen=True)
class CopyJob:
    """Copy `nbytes` from file `src` at `src_offset` to `dst_fd` at `dst_offset`."""

    src: Path
    src_offset: int
    dst_fd: int
    dst_offset: int
    nbytes: int


# data files a `ReadCache` keeps open at once (least recently used closed first)
MAX_OPEN_FILES = 64

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns

# what was parsed from files while a `fact_session` is open, by (what, path, file identity):
# shared by every reader of the command (the head start's and the merge's); a context variable,
# so a command on another thread has its own (its threads run in copies of its context)
Facts = dict[tuple[Hashable, Path, Identity], object]
_SESSION: ContextVar[Facts | None] = ContextVar("shardforge_facts", default=None)
_FACTS_LOCK = threading.Lock()


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@contextmanager
def fact_session() -> Iterator[None]:
    """Within the block (nested blocks join the outer one), every file fact is parsed once per
    command (its context: a command on another thread has its own); they are forgotten when the outermost block ends, so memory stays bounded and a
    later command (or test) that changed a file reads it afresh."""
    if _SESSION.get() is not None:
        yield
        return
    token = _SESSION.set({})
    try:
        yield
    finally:
        _SESSION.reset(token)


def _memo(
    store: dict[tuple[Hashable, Path, Identity], object],
    key: tuple[Hashable, Path, Identity],
    compute: Callable[[], T],
) -> T:
    """The stored fact (computed when absent). A fact parsed before torch was imported holds
    `DtypeName`s; once torch is, its `resolved()` (where it has one) gives torch's dtypes, and
    that replaces it (no file is parsed again)."""
    with _FACTS_LOCK:
        found = key in store
        value = store[key] if found else None
    if not found:
        value = compute()
    if torch_ready() and hasattr(value, "resolved"):
        value = value.resolved()
    with _FACTS_LOCK:
        if found:
            store[key] = value
            return value  # type: ignore[return-value]
        return store.setdefault(key, value)  # type: ignore[return-value]


def session_memo(key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()` once per `fact_session` for `key` (a folder scan, say); every time outside."""
    store = _SESSION.get()
    if store is None:
        return compute()
    return _memo(store, (key, Path(), (0, 0, 0, 0)), compute)


def file_fact(what: Hashable, path: Path, ident: Identity, compute: Callable[[], T]) -> T:
    """`compute()` for `what` of the file `path` with identity `ident`: once per process inside
    a `fact_session`, else computed every time."""
    store = _SESSION.get()
    return compute() if store is None else _memo(store, (what, path, ident), compute)


class ReadCache:
    """Open data files (regular files only: `open_regular` refuses a FIFO or a device, never
    waits on one) and the facts parsed from them (`fact`), for one reader at a time."""

    def __init__(self) -> None:
        self._fds: OrderedDict[Path, tuple[int, Identity]] = OrderedDict()
        self._own: dict[tuple[Hashable, Path, Identity], object] = {}  # outside a session

    def _open(self, path: Path) -> tuple[int, Identity]:
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if len(self._fds) >= MAX_OPEN_FILES:
            _, (old, _) = self._fds.popitem(last=False)
            os.close(old)
        fd = open_regular(path)
        self._fds[path] = (fd, identity(os.fstat(fd)))
        return self._fds[path]

    def fd(self, path: Path) -> int:
        return self._open(path)[0]

    def fact(self, path: Path, what: Hashable, compute: Callable[[int], T]) -> T:
        """`compute(fd)` for `what` of the data file `path`: once per process inside a
        `fact_session`, else once per cache."""
        fd, ident = self._open(path)
        found = _SESSION.get()
        store = self._own if found is None else found
        return _memo(store, (what, path, ident), lambda: compute(fd))

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ReadCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FileSlab:
    """`nbytes` bytes at `src_offset` of `path` are the tensor's bytes from `dst_offset` on."""

    path: Path
    src_offset: int
    nbytes: int
    dst_offset: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order (little-endian on the supported platforms)."""
    import torch

    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` of `fd` (and tell the file's hash, if it has one)."""
    pwrite_then_hash(fd, data, offset)


def pwrite_then_hash(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` of `fd`, then tell the file's hash (if it has one) that
    these bytes are written (`FileHash.written`: it reads them back from the file); into an
    `io.direct` output, hand them to it (gathered, hashed from memory, written)."""
    view = data.cast("B")  # lengths in bytes, whatever the element type
    direct = direct_of(fd)
    if direct is not None:  # gathered, hashed and written there (`io.direct`)
        direct.put(offset, view)
        return
    pwrite_whole(fd, view, offset)
    h = hash_of(fd)
    if h is not None:
        h.written(offset, len(view))


def copy_range(src: int, dst: int, src_off: int, dst_off: int, count: int) -> None:
    """Copy bytes file to file, in the kernel where possible (a stand-in of a stored object:
    its bytes by ranged requests, several at a time); each block copied into a hashed output
    file (`io.digest.hashing`) is told to its hash once written."""
    remote = remote_of(src)
    if remote is not None:  # each part written by `pwrite_then_hash`
        remote.copy_to(dst, src_off, dst_off, count, write=pwrite_then_hash)
        return
    direct = direct_of(dst)
    if direct is not None:  # read into its windows, hashed and written there (`io.direct`)
        direct.copy_from(src, src_off, dst_off, count)
        return
    h = hash_of(dst)
    while count > 0:
        try:
            n = os.copy_file_range(src, dst, min(count, COPY_BLOCK), src_off, dst_off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = 0
        if n == 0:  # unsupported here (or EOF): copy through a bounded buffer
            data = os.pread(src, min(count, COPY_BLOCK), src_off)
            if not data:
                raise CheckpointError("unexpected end of a data file while copying")
            pwrite_whole(dst, memoryview(data), dst_off)
            n = len(data)
        if h is not None:
            h.written(dst_off, n)
        src_off, dst_off, count = src_off + n, dst_off + n, count - n


def _run(job: CopyJob, copy: Callable[[int, int, int, int, int], None]) -> None:
    # Each job opens its own descriptor: a checkpoint may have thousands of data files, and
    # an open() costs microseconds next to a copy of megabytes.
    fd = open_regular(job.src)  # a regular file, never a FIFO (no wait)
    try:
        copy(fd, job.dst_fd, job.src_offset, job.dst_offset, job.nbytes)
    finally:
        os.close(fd)


def write_order(job: CopyJob) -> tuple[int, int]:
    """Jobs into a hashed output run in the order of their output bytes (its hash follows)."""
    return job.dst_fd, job.dst_offset


def _hashed(jobs: Sequence[CopyJob]) -> bool:
    """Whether the jobs fill hashed output files (`io.digest.hashing`) or `io.direct` ones
    (gathered in windows written in the file's order)."""
    return bool(jobs) and all(
        hash_of(job.dst_fd) is not None or direct_of(job.dst_fd) is not None for job in jobs
    )


def read_order(job: CopyJob) -> tuple[str, int]:
    """Jobs run in the order of their source bytes: each data file is read front to back, as
    `cp` reads it, whatever order the output wants its tensors in (the kernel's read-ahead
    works on sequential reads; the writes land in the page cache, where order does not
    matter)."""
    return str(job.src), job.src_offset


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def copy_threads() -> int:
    """Copies in flight at once: `SHARDFORGE_COPY_THREADS` when set; else the cores less one
    (one left to the rest of the merge: 1 on a 2-core machine), at most `MAX_COPY_THREADS`, and
    no more than `OMP_NUM_THREADS` where that is set (a merge rank's share of the cores; 1 for
    the merge that runs beside training)."""
    chosen = _env_int(THREADS_ENV)
    if chosen is not None and chosen > 0:
        return chosen
    share = _env_int("OMP_NUM_THREADS")
    share = MAX_COPY_THREADS if share is None else share
    return max(1, min(MAX_COPY_THREADS, share, (os.cpu_count() or 1) - 1))


def pieces(jobs: Sequence[CopyJob], size: int | None = None) -> list[CopyJob]:
    """The jobs cut into pieces of at most `size` bytes (`READ_PIECE`), in order (a stored
    object's stand-in is left whole: its ranged requests are sized by `io.remote`)."""
    size = READ_PIECE if size is None else size
    out: list[CopyJob] = []
    for job in jobs:
        if job.nbytes <= size or remote_of_path(job.src) is not None:
            out.append(job)
            continue
        for at in range(0, job.nbytes, size):
            n = min(size, job.nbytes - at)
            out.append(CopyJob(job.src, job.src_offset + at, job.dst_fd, job.dst_offset + at, n))
    return out


def copy_jobs(
    jobs: Sequence[CopyJob],
    copy: Callable[[int, int, int, int, int], None],
    progress: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
    threads: int | None = None,
) -> bool:
    """Run `copy(src_fd, dst_fd, src_offset, dst_offset, nbytes)` for every job, cut into
    `pieces`, started in `read_order` on `threads` threads (default `copy_threads()`), each
    piece's source read ahead (`ReadAhead`), reporting each piece's bytes to `progress` once it
    is done (in that order). `stop` is asked before every job: True skips
    the jobs not started yet, and then this returns False. The first error is raised once the
    copies already running have finished.

    Jobs that fill hashed output files (`io.digest.hashing`) run in `write_order` instead:
    each file's hash reads its written bytes back as the copy advances through it."""
    ordered = pieces(sorted(jobs, key=write_order if _hashed(jobs) else read_order))
    n = copy_threads() if threads is None else threads
    ahead = ReadAhead(ordered, read_ahead_depth(n)) if hasattr(os, "posix_fadvise") else None
    try:
        return _run_all(ordered, copy, n, ahead, progress, stop)
    finally:
        if ahead is not None:
            ahead.close()


def _run_all(
    ordered: Sequence[CopyJob],
    runner: Callable[[int, int, int, int, int], None],
    n: int,
    ahead: ReadAhead | None,
    progress: Callable[[int], None] | None,
    stop: Callable[[], bool] | None,
) -> bool:
    """`copy_jobs` of its ordered pieces on `n` threads (the read-ahead told of each start)."""

    def one(index: int, job: CopyJob) -> bool:
        if stop is not None and stop():
            return False
        if ahead is not None:
            ahead.started(index)
        _run(job, runner)
        return True

    if n <= 1 or len(ordered) <= 1:
        for i, job in enumerate(ordered):
            if not one(i, job):
                return False
            if progress is not None:
                progress(job.nbytes)
        return True
    done = True
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="shardforge-copy") as pool:
        # each job in a copy of this context: the merge's pins and facts (`io.pins`)
        futures = [pool.submit(copy_context().run, one, i, job) for i, job in enumerate(ordered)]
        try:
            for job, fut in zip(ordered, futures, strict=True):
                if not fut.result():
                    done = False
                elif progress is not None:
                    progress(job.nbytes)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return done
