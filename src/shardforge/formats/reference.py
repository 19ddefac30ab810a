"""What every format's independent reader (`CheckpointFormat.reference`, for `--verify`) shares:
the failure message, an exception in one line, torch's notices held back, zip CRC checks.

Verification reads each stored tensor through another path than the merge's (torch's DCP
reader, ``torch.load(weights_only=True)``, the `safetensors` library); these helpers hold no
tensor bytes and parse nothing themselves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from shardforge.errors import MergeError, printable


def verify_failed(name: str, where: Path | str, problem: str) -> MergeError:
    return MergeError(
        f"verification failed: {printable(name)} in {where} {problem}; the output is not "
        "trustworthy"
    )


def short_reason(exc: Exception) -> str:
    """An exception from torch in one short, printable line."""
    lines = str(exc).strip().splitlines()
    return printable(f"{type(exc).__name__}: {lines[0][:200] if lines else ''}")


@contextlib.contextmanager
def torch_quiet() -> Iterator[None]:
    """Hold back torch's notices while it reads a checkpoint outside a process group (DCP's
    "single process" warning, DeviceMesh's "unpickled before the process groups")."""
    logger = logging.getLogger("torch.distributed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)


def check_zip_crcs(path: Path, root: Path, windows: Sequence[tuple[int, int]]) -> None:
    """Check every member of the zip records at `windows` ((start, length)) of `path` (inside
    the checkpoint `root`) against its stored CRC-32."""
    from shardforge.io.files import open_regular
    from shardforge.io.zip_record import check_crc, read_zip_record

    fd = open_regular(path, root)
    try:
        for start, length in windows:
            record = read_zip_record(fd, start, length, str(path))
            for member in record.members.values():
                check_crc(fd, member, str(path))
    finally:
        os.close(fd)


def torch_load(path: Path) -> object:
    """``torch.load(path, weights_only=True, mmap=True)`` for verification (torch's own
    allow-list, the file mapped, not read; a file in object storage is read through fsspec);
    a failure is a `MergeError` naming the file."""
    import torch
    import torch.distributed.tensor

    from shardforge.io.mirror import remote_location

    remote = remote_location(path)
    try:
        with torch_quiet():
            if remote is None:
                return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
            from shardforge.io.remote import filesystem

            uri, options = remote  # in object storage: read through fsspec (no mmap)
            with filesystem(options).open(uri.path, "rb") as f:
                return torch.load(f, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise MergeError(
            f"verification failed: torch.load(weights_only=True) cannot read {path} "
            f"({short_reason(exc)})"
        ) from None
