"""Disk-speed helpers for the merge's byte path: read-ahead and parallel file-to-file copies.

- `prefetch`: ask the kernel to start reading the checkpoint's data files into the page cache
  (`posix_fadvise(WILLNEED)`, asynchronous, no memory held by this process) while the merge is
  still importing transformers and checking the architecture. Bounded by a budget so that a
  checkpoint larger than RAM does not evict its own first bytes.
- `copy_jobs`: run many `copy_file_range` copies, one after the other. The copies happen in the
  kernel (the GIL released: the merge goes on importing and checking meanwhile); the kernel's
  read-ahead and write-back keep the disk busy. No tensor bytes pass through Python. One
  thread per output file, on purpose: several threads writing one file contend for its inode
  lock, and on a 2-core machine a 4-thread copy of 4 GB burned 21 s of kernel CPU (against 3 s)
  and starved the import it was meant to overlap (benchmarks/README.md, "byte-path profile").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardforge.io.files import open_regular

# Never prefetch more than this share of the memory the kernel reports as available.
PREFETCH_SHARE_OF_AVAILABLE = 0.5


@dataclass(frozen=True)
class CopyJob:
    """Copy `nbytes` from file `src` at `src_offset` to `dst_fd` at `dst_offset`."""

    src: Path
    src_offset: int
    dst_fd: int
    dst_offset: int
    nbytes: int


def available_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # pragma: no cover - psutil is a dependency; be safe anyway
        return 0


def prefetch(files: Iterable[Path], budget: int | None = None) -> int:
    """Start asynchronous read-ahead of `files` (in order) up to `budget` bytes; return bytes
    requested. Errors are ignored: this is only a hint."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    if budget is None:
        budget = int(available_memory() * PREFETCH_SHARE_OF_AVAILABLE)
    asked = 0
    for path in files:
        if asked >= budget:
            break
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: no wait
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            length = min(size, budget - asked)
            os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
            asked += length
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def _run(job: CopyJob, copy: Callable[[int, int, int, int, int], None]) -> None:
    # Each job opens its own descriptor: a checkpoint may have thousands of data files, and
    # an open() costs microseconds next to a copy of megabytes.
    fd = open_regular(job.src)  # a regular file, never a FIFO (no wait)
    try:
        copy(fd, job.dst_fd, job.src_offset, job.dst_offset, job.nbytes)
    finally:
        os.close(fd)


def read_order(job: CopyJob) -> tuple[str, int]:
    """Jobs run in the order of their source bytes: each data file is read front to back, as
    `cp` reads it, whatever order the output wants its tensors in (the kernel's read-ahead
    works on sequential reads; the writes land in the page cache, where order does not
    matter)."""
    return str(job.src), job.src_offset


def copy_jobs(
    jobs: Sequence[CopyJob],
    copy: Callable[[int, int, int, int, int], None],
    progress: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> bool:
    """Run `copy(src_fd, dst_fd, src_offset, dst_offset, nbytes)` for every job, in
    `read_order`, reporting each job's bytes to `progress` once it is done. `stop` is asked
    before every job: True ends the copy early, and then this returns False."""
    for job in sorted(jobs, key=read_order):
        if stop is not None and stop():
            return False
        _run(job, copy)
        if progress is not None:
            progress(job.nbytes)
    return True
