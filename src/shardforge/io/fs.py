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


def fsync_file(path: Path) -> None:
    """Make the bytes written to the file `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file below `root` (symbolic links are not followed), then every
    directory, deepest first: what a publisher calls before the rename that makes it visible.
    A file already fsynced costs one system call."""
    dirs = []
    for top, _subdirs, files in os.walk(root, followlinks=False):
        dirs.append(Path(top))
        for name in files:
            path = Path(top) / name
            if path.is_file() and not path.is_symlink():
                fsync_file(path)
    for d in reversed(dirs):
        fsync_dir(d)


_FALLOC_KEEP_SIZE_PUNCH_HOLE = 0x01 | 0x02


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give the blocks of [offset, offset + length) back to the file system (the file keeps its
    size and reads zeros there); False where the system or file system cannot."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn(fd, _FALLOC_KEEP_SIZE_PUNCH_HOLE, offset, length) == 0
