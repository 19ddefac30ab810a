"""The SHA-256 of an output file, computed from the bytes as they are written (never read back).

SHA-256 takes a file's bytes in order, and the merge writes them in another: copies start in
the order of their source bytes, casts run on several threads, an early copy fills some tensors
before the rest are known. A `FileHash` therefore takes every piece written at its offset and
hashes in file order:

- `feed(offset, data)`: a piece written at `offset`; hashed at once when everything before it
  has been, else kept (a copy) until then. The writers of one output file keep to its order
  tensor by tensor, so what is kept stays within about one tensor.
- `feed_in_turn(offset, data)`: the same, but waits until everything before `offset` has been
  hashed: the copy jobs of one file, run in file order on several threads, hand their blocks
  over this way (each thread holds one block; `io.copy.copy_jobs`).
- `defer(offset, path, src_offset, n)`: bytes copied in the kernel (`copy_file_range`) while
  an earlier range is not written yet; they are read from their source file when the hash
  reaches them (the early copy's tensors after a gap: `merge.overlap`).
- `feed_written(fd, offset, data)`: a piece already written at `offset` of the output `fd`;
  hashed at once when in turn, else read back from the output (its page cache) when the hash
  reaches it, nothing kept. The parallel ranged GETs of a stored object (`io.remote`) write
  their bodies this way: up to `PARALLEL` parts arrive out of order, and keeping them would
  hold about 100 MB per stream.

`hashing(fd, h)` registers `h` for the open output file `fd`: `io.copy`'s `pwrite_all` and
`copy_range` then feed it every byte they write there, whichever code calls them (a format's
`TensorSource.write`, a cast thread). `abort()` wakes every waiting thread with an error, so a
failed or stopped copy never leaves one waiting.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from shardforge.errors import MergeError
from shardforge.io.files import open_regular, read_exact_into

# bytes of a deferred piece read (and hashed) at a time
DEFERRED_BLOCK = 8 << 20


class HashAbandoned(MergeError):
    """A piece could not be hashed because another writer of the file failed or stopped
    (`FileHash.abort`): a consequence, never the cause, of the error to report."""


@dataclass(frozen=True)
class _Deferred:
    """`n` bytes at `src_offset` of `path`, copied to the output without passing through here."""

    path: Path
    src_offset: int
    n: int


@dataclass(frozen=True)
class _Written:
    """`n` bytes already written at `offset` of the open output file `fd`."""

    fd: int
    offset: int
    n: int


class FileHash:
    """The SHA-256 of one output file, fed its pieces in any order (see the module docstring)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.frontier = 0  # every byte before it is hashed
        self._pending: dict[int, bytes | _Deferred | _Written] = {}
        self._cond = threading.Condition()
        self._failed: str | None = None

    def feed(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """`data` was written at `offset` (hashed now, or kept until its turn)."""
        with self._cond:
            self._check()
            if offset != self.frontier:
                self._keep(offset, bytes(data))
                return
            self._sha.update(data)
            self.frontier += len(data)
            self._advance()

    def feed_in_turn(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """`data` was read for `offset`: wait until every byte before it is hashed, hash it."""
        with self._cond:
            while self.frontier < offset and self._failed is None:
                self._cond.wait()
            self._check()
            if self.frontier != offset:
                raise MergeError(f"internal error: bytes at {offset} were hashed twice")
            self._sha.update(data)
            self.frontier += len(data)
            self._advance()

    def feed_written(self, fd: int, offset: int, data: bytes | bytearray | memoryview) -> None:
        """`data` is written at `offset` of `fd` (the output): hashed now if in turn, else read
        back from `fd` when it is (nothing kept meanwhile)."""
        with self._cond:
            self._check()
            if offset != self.frontier:
                self._keep(offset, _Written(fd, offset, len(data)))
                return
            self._sha.update(data)
            self.frontier += len(data)
            self._advance()

    def defer(self, offset: int, path: Path, src_offset: int, n: int) -> None:
        """`n` bytes at `src_offset` of `path` were copied to `offset` in the kernel."""
        with self._cond:
            self._check()
            self._keep(offset, _Deferred(path, src_offset, n))
            self._advance()

    def abort(self, why: str) -> None:
        """No more bytes will come: every waiting thread (and later call) raises."""
        with self._cond:
            self._failed = self._failed or why
            self._cond.notify_all()

    def hexdigest(self, size: int) -> str:
        """The file's SHA-256, once all `size` bytes were fed."""
        with self._cond:
            self._check()
            if self.frontier != size or self._pending:
                raise MergeError(
                    f"internal error: {self.frontier} of {size} bytes hashed, "
                    f"{len(self._pending)} pieces out of order"
                )
            return self._sha.hexdigest()

    def _keep(self, offset: int, piece: bytes | _Deferred | _Written) -> None:
        if offset < self.frontier or offset in self._pending:
            raise MergeError(f"internal error: bytes at {offset} were written twice")
        self._pending[offset] = piece

    def _advance(self) -> None:
        """Hash the kept pieces that are now in turn; wake the threads waiting for theirs."""
        while self.frontier in self._pending:
            piece = self._pending.pop(self.frontier)
            if isinstance(piece, _Deferred):
                self._hash_source(piece)
            elif isinstance(piece, _Written):
                self._hash_range(piece.fd, piece.offset, piece.n, "the output file")
                self.frontier += piece.n
            else:
                self._sha.update(piece)
                self.frontier += len(piece)
        self._cond.notify_all()

    def _hash_source(self, piece: _Deferred) -> None:
        fd = open_regular(piece.path)
        try:
            self._hash_range(fd, piece.src_offset, piece.n, str(piece.path))
        finally:
            os.close(fd)
        self.frontier += piece.n

    def _hash_range(self, fd: int, offset: int, n: int, label: str) -> None:
        """Hash `n` bytes at `offset` of `fd`, read `DEFERRED_BLOCK` at a time."""
        buf = bytearray(min(n, DEFERRED_BLOCK))
        done = 0
        while done < n:
            view = memoryview(buf)[: min(len(buf), n - done)]
            read_exact_into(fd, view, offset + done, label)
            self._sha.update(view)
            done += len(view)

    def _check(self) -> None:
        if self._failed is not None:
            raise HashAbandoned(f"the output's hash was abandoned: {self._failed}")


# open output file descriptor -> the hash its writes feed (`hashing`)
_HASHES: dict[int, FileHash] = {}
_LOCK = threading.Lock()


@contextmanager
def hashing(fd: int, h: FileHash | None) -> Iterator[None]:
    """Within the block every byte `io.copy` writes to `fd` feeds `h` (None: nothing)."""
    if h is None:
        yield
        return
    with _LOCK:
        if fd in _HASHES:
            raise MergeError(f"internal error: descriptor {fd} is hashed twice")
        _HASHES[fd] = h
    try:
        yield
    finally:
        with _LOCK:
            _HASHES.pop(fd, None)


def hash_of(fd: int) -> FileHash | None:
    """The hash that writes to `fd` feed, if any."""
    return _HASHES.get(fd)
