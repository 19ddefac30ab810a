"""Reading ahead of the byte path: the kernel is asked to read source bytes before they are
needed (`posix_fadvise(WILLNEED)`: asynchronous, into the page cache, no memory held by this
process).

- `prefetch`: the checkpoint's data files, front to back, while the merge is still importing
  transformers and checking the architecture; bounded by a budget so that a checkpoint larger
  than RAM does not evict its own first bytes.
- `ReadAhead`: the pieces of a run of copy jobs (`io.copy.copy_jobs`), each asked for
  `read_ahead_depth()` pieces before its copy starts, in the order the pieces run: the disk
  reads several MB per request with several requests in flight, while the copies and the
  output's hash work on what is already read. Without it a mapped block of cold data is read
  as its pages are touched, in the kernel's small read-around steps, one at a time, and the
  hash of a hashed output waited on every one (benchmarks/README.md, "Issue 28").
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from shardforge.errors import CheckpointError
from shardforge.io.files import open_regular
from shardforge.io.remote import remote_of

# Never prefetch more than this share of the memory the kernel reports as available.
PREFETCH_SHARE_OF_AVAILABLE = 0.5
# pieces asked ahead of the one starting, at least (more with more threads: `read_ahead_depth`)
READ_AHEAD_PIECES = 8


class Piece(Protocol):
    """Source bytes to read: `nbytes` at `src_offset` of the file `src` (an `io.copy.CopyJob`)."""

    @property
    def src(self) -> Path: ...

    @property
    def src_offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


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


def read_ahead_depth(threads: int) -> int:
    """Pieces asked ahead of the one starting: enough requests in flight for a fast disk
    (`READ_AHEAD_PIECES`, two per thread when more)."""
    return max(READ_AHEAD_PIECES, 2 * threads)


class ReadAhead:
    """`posix_fadvise(WILLNEED)` of the source bytes of `jobs`, in their order, `depth` pieces
    ahead of the latest one started (`started`): the kernel reads them in the background, in
    requests of a piece each, several in flight. A hint: errors are ignored; a stored object's
    stand-in is skipped (its bytes come by ranged requests)."""

    def __init__(self, jobs: Sequence[Piece], depth: int) -> None:
        self._jobs = jobs
        self._depth = depth
        self._next = 0  # the first job not asked for yet
        self._lock = threading.Lock()
        self._fds: dict[Path, int | None] = {}

    def started(self, index: int) -> None:
        """Job `index` starts: ask for every job up to `depth` after it."""
        with self._lock:  # held while asking: no piece is copied before it was asked for
            end = min(len(self._jobs), index + 1 + self._depth)
            for job in self._jobs[self._next : end]:
                fd = self._fd(job.src)
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, job.src_offset, job.nbytes, os.POSIX_FADV_WILLNEED)
            self._next = max(self._next, end)

    def _fd(self, path: Path) -> int | None:
        if path not in self._fds:
            try:
                fd: int | None = open_regular(path)
            except (OSError, CheckpointError):
                fd = None
            if fd is not None and remote_of(fd) is not None:
                os.close(fd)
                fd = None
            self._fds[path] = fd
        return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
