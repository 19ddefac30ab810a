"""Nothing lost: write into a temporary sibling directory, rename at the end, clean up on any
error, SIGTERM or Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from shardforge.errors import MergeError
from shardforge.fsutil import fsync_dir

# free space kept in reserve beyond the planned output size
DISK_MARGIN = 16 << 20


def temp_sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}"


def check_output_path(out: Path, overwrite: bool, inputs: list[Path]) -> None:
    """Refuse an output that exists (unless overwrite) or overlaps the checkpoint."""
    for src in inputs:
        s, o = src.resolve(), out.resolve()
        if o == s or o.is_relative_to(s) or s.is_relative_to(o):
            raise MergeError(
                f"{out}: the output path overlaps the checkpoint {src}; choose another directory"
            )
    if out.exists():
        if not out.is_dir():
            raise MergeError(f"{out}: exists and is not a directory; choose another output path")
        if any(out.iterdir()) and not overwrite:
            raise MergeError(
                f"{out}: output directory exists and is not empty; pass --overwrite to replace it"
            )


def check_free_space(out: Path, needed: int) -> None:
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed + DISK_MARGIN:
        raise MergeError(
            f"{parent}: not enough free disk space: the merged model needs {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free"
        )


def _fresh_temp_sibling(out: Path) -> Path:
    """An empty hidden directory beside `out` (a leftover of an interrupted run is replaced)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(out, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it becomes `out` (replacing any
    previous one), on any exception it is removed and `out` is left as it was."""
    tmp = _fresh_temp_sibling(out)
    try:
        yield tmp
        fsync_dir(tmp)
        if out.exists():
            old = temp_sibling(out, "old")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)  # put the previous output back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_output_file(out: Path, overwrite: bool, inputs: list[Path]) -> None:
    """Refuse an output file that exists (unless overwrite), is a directory, or lies inside
    the checkpoint."""
    for src in inputs:
        if out.resolve().is_relative_to(src.resolve()):
            raise MergeError(f"{out}: the output file lies inside the checkpoint {src}")
    if out.is_dir():
        raise MergeError(f"{out}: is a directory; --format safetensors/torch write one file")
    if out.exists() and not overwrite:
        raise MergeError(f"{out}: output file exists; pass --overwrite to replace it")


@contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success the file `out.name` written in it
    replaces `out`, on any exception the directory is removed and `out` is left as it was."""
    tmp = _fresh_temp_sibling(out)
    try:
        yield tmp
        os.replace(tmp / out.name, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
