"""Disk-speed helpers for the merge's byte path: read-ahead and parallel file-to-file copies.

- `prefetch`: ask the kernel to start reading the checkpoint's data files into the page cache
  (`posix_fadvise(WILLNEED)`, asynchronous, no memory held by this process) while the merge is
  still importing transformers and checking the architecture. Bounded by a budget so that a
  checkpoint larger than RAM does not evict its own first bytes.
- `copy_jobs`: run many `copy_file_range` copies on a few threads. The copies happen in the
  kernel with the GIL released, so several requests are in flight at once, which is what a
  virtual or NVMe disk needs to reach its throughput. No tensor bytes pass through Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shardforge.io.files import open_regular

COPY_WORKERS = 4
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


def copy_jobs(
    jobs: Sequence[CopyJob],
    copy: Callable[[int, int, int, int, int], None],
    progress: Callable[[int], None] | None = None,
    workers: int = COPY_WORKERS,
) -> None:
    """Run `copy(src_fd, dst_fd, src_offset, dst_offset, nbytes)` for every job on `workers`
    threads; progress is reported in job order; the first error is raised once the copies
    already running have finished."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            _run(job, copy)
            if progress is not None:
                progress(job.nbytes)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardforge-copy") as pool:
        futures = [pool.submit(_run, j, copy) for j in jobs]
        try:
            for job, fut in zip(jobs, futures, strict=True):
                fut.result()
                if progress is not None:
                    progress(job.nbytes)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
