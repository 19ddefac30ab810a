"""What every format's independent reader (`CheckpointFormat.reference`, for `--verify`) shares:
the failure message, an exception in one line, torch's notices held back, zip CRC checks.

Verification reads each stored tensor through another path than the merge's (torch's DCP
reader, ``torch.load(weights_only=True)``, the `safetensors` library); these helpers hold no
tensor bytes and parse nothing themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

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
    allow-list, the file mapped, not read; a file in object storage is downloaded whole once
    per merge into the staging area by s3fs, `io.mirror.whole_copy`); a failure is a
    `MergeError` naming the file."""
    import torch
    import torch.distributed.tensor

    from shardforge.io.mirror import whole_copy

    local = whole_copy(path)  # in object storage: downloaded once, then mapped as any file
    try:
        with torch_quiet():
            return torch.load(local, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:
        raise MergeError(
            f"verification failed: torch.load(weights_only=True) cannot read {path} "
            f"({short_reason(exc)})"
        ) from None


# bytes of a file in object storage copied at a time for `safetensors_file`
COPY_BLOCK = 8 << 20
# the largest safetensors header `safetensors_file` fetches (the library's own limit)
MAX_HEADER = 100_000_000


@contextlib.contextmanager
def safetensors_file(path: Path, keys: Collection[str]) -> Iterator[Path]:
    """`path` as the `safetensors` library can open it. A file in object storage (a stand-in
    of the staging area, holding no bytes) becomes a sparse local file of its size that holds
    its header and the bytes of `keys` only, fetched through s3fs's own reads (not the
    merge's); removed when the block ends. A header that does not fit the file is copied as
    it is, for the library to refuse."""
    from shardforge.io.mirror import STAGING_ENV, remote_location

    remote = remote_location(path)
    if remote is None:
        yield path
        return
    from shardforge.io.remote import filesystem

    uri, options = remote
    fs = filesystem(options)
    parent = os.environ.get(STAGING_ENV) or None
    with tempfile.TemporaryDirectory(prefix="shardforge-verify-", dir=parent) as tmp:
        local = Path(tmp) / path.name
        with fs.open(uri.path, "rb") as src, local.open("wb") as out:
            size = int(fs.size(uri.path))
            out.truncate(size)
            for start, end in _ranges(src, size, keys):
                _copy(src, out, start, end)
        yield local


def _ranges(src: Any, size: int, keys: Collection[str]) -> list[tuple[int, int]]:
    """The header's bytes and each of `keys`' data bytes in a safetensors file of `size`."""
    length = int.from_bytes(src.read(8), "little")
    if not 0 < length <= min(MAX_HEADER, size - 8):
        return [(0, min(size, 8))]
    ranges = [(0, 8 + length)]
    src.seek(8)
    try:
        header = json.loads(src.read(length))
    except ValueError:
        return ranges
    base = 8 + length
    for key in keys:
        entry = header.get(key) if isinstance(header, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if isinstance(offsets, list) and len(offsets) == 2:
            start, end = (int(x) for x in offsets)
            if 0 <= start <= end <= size - base:  # inside the file, else the library refuses
                ranges.append((base + start, base + end))
    return ranges


def _copy(src: Any, out: Any, start: int, end: int) -> None:
    src.seek(start)
    out.seek(start)
    while start < end:
        block = src.read(min(COPY_BLOCK, end - start))
        if not block:
            raise MergeError(f"verification failed: {src.path} ends before byte {end}")
        out.write(block)
        start += len(block)
