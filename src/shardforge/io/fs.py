"""File-system helpers shared by training (checkpoint saves) and the merge (atomic outputs)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preallocate(fd: int, size: int) -> None:
    """Give the file `size` bytes on disk at once (a sparse size where the filesystem cannot
    allocate); running out of space is an OSError here, before any byte is written."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise
        os.ftruncate(fd, size)
