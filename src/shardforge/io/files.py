"""Open checkpoint files for reading: regular files only, inside their checkpoint.

`open_regular` never blocks (a FIFO put in place of a data file is opened non-blocking and
refused, as are devices, sockets and directories) and, given the checkpoint's root, refuses a
path that leaves it once symlinks are resolved (a checkpoint directory that is itself a symlink
is fine: the root is resolved the same way). Inside a merge every open is checked against the
file's pin (`io.pins`): a file replaced or rewritten since the plan is refused. `read_json`
reads a small JSON file of a checkpoint, run or model folder as untrusted input: its size capped
before a byte is read, its nesting bounded, each failure one line naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError, MergeError
from shardforge.io.pins import opened
from shardforge.io.remote import remote_of

# the JSON files a command reads from a checkpoint, a run or a model folder (trainer_state.json,
# config.json, fsdp_config.json, an index): a config is kilobytes, trainer_state.json's log grows
# by about 200 bytes per logged step (a few MB for a long run), an index by ~100 bytes per tensor
MAX_JSON_BYTES = 16 << 20


def inside(path: Path, root: Path) -> bool:
    """True when `path`, symlinks resolved, lies inside `root` (symlinks resolved too)."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):
        return False


def open_regular(path: str | Path, root: str | Path | None = None) -> int:
    """A read-only file descriptor of the regular file `path`; CheckpointError otherwise.

    With `root`, the file must lie inside `root` after resolving symlinks. The resolved path is
    opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` (no race between the
    check and the open: the checked object is the opened one).
    """
    p = Path(path)
    real = os.path.realpath(p)
    if root is not None and not inside(p, Path(root)):
        raise CheckpointError(
            f"{p}: resolves to {real}, outside the checkpoint {root}; refusing to read it "
            "(copy the file into the checkpoint instead of linking it)"
        )
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{p}: is {_kind(st.st_mode)}, not a regular file; a checkpoint holds only "
                "regular files"
            )
        opened(real, st, p)  # a pinned input: still the file the merge planned from (io.pins)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_resolvable(path: Path, what: str = "output path") -> None:
    """Refuse `path` when its symlinks cannot be resolved (a loop of directory links): one
    line before anything is read or written, not a RuntimeError from `Path.resolve` later."""
    try:
        path.resolve()
    except (RuntimeError, OSError) as exc:
        reason = "a loop of symbolic links" if isinstance(exc, RuntimeError) else str(exc)
        raise MergeError(
            f"{path}: the {what} cannot be resolved ({reason}); choose another {what}"
        ) from None


def read_json(path: str | Path, root: str | Path | None = None, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in the regular file `path` (inside `root` when given), its size
    checked before it is read; CheckpointError naming the file when it is larger than
    `limit`, not UTF-8 JSON, or nested too deeply for the parser."""
    p = Path(path)
    fd = open_regular(p, root)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(
                f"{p}: {size:,} bytes, more than the {limit:,} a {p.name} of a checkpoint or "
                "model folder may have; refusing to read it (is it the right file?)"
            )
        data = bytearray(size)
        read_exact_into(fd, data, 0, str(p))
    finally:
        os.close(fd)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise CheckpointError(f"{p}: not valid JSON ({type(exc).__name__}: {reason})") from None


def check_size(path: str | Path, limit: int = MAX_JSON_BYTES) -> None:
    """Refuse the file `path`, when it exists, if it is larger than `limit` (a file another
    library parses whole: a model's config.json before transformers reads it)."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return  # not there: the reader says so
    if size > limit:
        raise CheckpointError(
            f"{path}: {size:,} bytes, more than the {limit:,} a {Path(path).name} may have; "
            "refusing to read it (is it the right file?)"
        )


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def read_exact_into(fd: int, buf: bytearray | memoryview, offset: int, label: str) -> None:
    """Fill `buf` from byte `offset` of `fd` (several reads where the kernel gives fewer bytes,
    as Linux does past 2 GiB); CheckpointError when the file ends first, never zeros."""
    view = memoryview(buf).cast("B")
    remote = remote_of(fd)  # a stand-in of an object in a store: ranged requests
    if remote is not None:
        remote.read_into(view, offset, label)
        return
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(
                f"{label}: short read at byte {offset + done} ({len(view) - done} bytes missing); "
                "the file is truncated or changed during the merge"
            )
        done += n
