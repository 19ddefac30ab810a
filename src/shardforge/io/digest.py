"""The hash of an output file, taken from the output's own bytes as they are written.

The integrity manifest (`sinks.manifest`) lists each file's BLAKE3 (the default: multithreaded
within one file, about 5 GB/s per core) or SHA-256 (`--manifest_hash sha256`, for comparing
with the digests the Hub lists). Both take a file's bytes in order; the merge writes them in
another (copies on several threads, casts, an early copy that fills some tensors before the rest
are known). A `FileHash` is given the bytes that come next in the file's order from memory
(`absorb`: the windows `io.direct` writes with O_DIRECT), or told where a write landed
(`written(offset, n)`) and hashes, on a thread of its own, what lies before the frontier of
contiguous written bytes: read back from the output file (a mapping of its page cache,
`HASH_SLICE` at a time). Either way the digest is that of the very bytes written, never of a
separate read of the input. The copy never waits for
the hash: the hash follows it a few tens of MB behind (`CHUNK`), and the copy's threads stay
free; a finished file's digest (`hexdigest`) waits only for that remainder.

`hashing(fd, h)` registers `h` for the open output file `fd`: `io.copy`'s `pwrite_all`,
`copy_range` and `pwrite_then_hash` then tell it of every byte they write there, whichever code
calls them (a format's `TensorSource.write`, a cast thread, a stored object's ranged GETs).
`hash_file` hashes a whole file already written (the small files beside the weights, the files a
merge on several ranks wrote together, a kept file of `--resume`).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardforge.errors import MergeError

BLAKE3 = "blake3"
SHA256 = "sha256"
ALGORITHMS = (BLAKE3, SHA256)  # the manifest's hash: the first is the default
DEFAULT = BLAKE3
# the hash runs once this many contiguous bytes are written and not hashed yet
CHUNK = 32 << 20
# bytes of the output mapped at a time (the mapping's pages count in the process's RSS: 16 MB
# cost 12 MB more peak RSS than 4 MB and hashed no faster)
HASH_SLICE = 4 << 20
# hashes running at once (each BLAKE3 also uses every core for a large slice)
HASH_THREADS = 2


def new_hasher(algo: str) -> Any:
    """A fresh hasher of `algo` (`ALGORITHMS`); BLAKE3 on every core."""
    if algo == BLAKE3:
        import blake3

        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if algo == SHA256:
        return hashlib.sha256()
    raise MergeError(f"internal error: unknown hash {algo!r}")


def hash_file(path: Path, algo: str) -> str:
    """The `algo` digest of a whole file already written (BLAKE3 on every core)."""
    h = new_hasher(algo)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _hash_fd(h, fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return str(h.hexdigest())


def _hash_fd(h: Any, fd: int, start: int, stop: int) -> None:
    """Feed `h` the bytes [start, stop) of `fd`, mapped `HASH_SLICE` at a time."""
    while start < stop:
        end = min(stop, start + HASH_SLICE)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fd, end - base, mmap.MAP_SHARED, mmap.PROT_READ, offset=base)
        with mapped, memoryview(mapped) as whole, whole[start - base :] as view:
            h.update(view)
        start = end


_POOL = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="shardforge-hash")


class FileHash:
    """The `algo` digest of the output file at `path`, read back behind its writers (see the
    module docstring). `written` from any thread; `hexdigest` once every byte is written."""

    def __init__(self, path: Path, algo: str = DEFAULT) -> None:
        self.algo = algo
        self._h = new_hasher(algo)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # stays valid across renames
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)
        self.frontier = 0  # every byte before it is written
        self.hashed = 0  # every byte before it is hashed
        self._pending: dict[int, int] = {}  # offset -> length of a write past the frontier
        self._cond = threading.Condition()
        self._busy = False  # a thread is hashing [hashed, ...)
        self._queued = False  # a background catch-up is submitted
        self._done = False  # the digest was taken (or the hash closed)
        self._error: BaseException | None = None

    def written(self, offset: int, n: int) -> None:
        """`n` bytes were written at `offset` (the hash catches up in the background)."""
        with self._cond:
            self._check()
            if offset < self.frontier or offset in self._pending:
                raise MergeError(f"internal error: bytes at {offset} were written twice")
            self._pending[offset] = n
            while self.frontier in self._pending:
                self.frontier += self._pending.pop(self.frontier)
            if not self._queued and not self._busy and self.frontier - self.hashed >= CHUNK:
                self._queued = True
                _POOL.submit(self._background)

    def absorb(self, offset: int, view: memoryview) -> bool:
        """Hash `view`, the bytes about to be written at `offset`, from memory, when they come
        next in the file's order (every byte before `offset` written: those not hashed yet are
        read back first); False (nothing done) when they do not: the writer then writes them
        and tells `written`. For `io.direct`, whose O_DIRECT writes leave nothing to read back."""
        with self._cond:
            self._check()
            if offset != self.frontier:
                return False
        self._drive(offset)
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._check()
            if offset != self.frontier or self.hashed != offset or self._done:
                return False
            self._busy = True
        try:
            self._h.update(view)
        except BaseException as exc:
            with self._cond:
                self._error = self._error or exc
            raise
        finally:
            with self._cond:
                self._busy = False
                if self._error is None:
                    self.hashed = self.frontier = offset + len(view)
                    while self.frontier in self._pending:
                        self.frontier += self._pending.pop(self.frontier)
                self._cond.notify_all()
        return True

    def wait_hashed(self, upto: int) -> None:
        """Return once every byte before `upto` (written already) is hashed: the caller may
        then drop them (a staging file's uploaded parts)."""
        self._drive(upto)

    def hexdigest(self, size: int) -> str:
        """The file's digest, once all `size` bytes were written (the rest hashed now)."""
        with self._cond:
            complete = self.frontier == size and not self._pending
        if complete:
            self._drive(size)
        with self._cond:
            if not complete or self.hashed != size:
                raise MergeError(
                    f"internal error: {self.frontier} of {size} bytes written in order, "
                    f"{len(self._pending)} pieces out of order"
                )
            self._done = True
            self._close()
            return str(self._h.hexdigest())

    def close(self) -> None:
        """No digest will be asked for (a failed or discarded write): the output let go."""
        with self._cond:
            self._done = True
            while self._busy:
                self._cond.wait()
            self._close()

    def _background(self) -> None:
        with contextlib.suppress(BaseException):  # kept in `_error`, raised to whoever asks
            self._drive(None)

    def _drive(self, upto: int | None) -> None:
        """Hash what is written until `hashed` reaches `upto` (None: the background's turn,
        which stops once less than `CHUNK` is left to hash)."""
        while True:
            with self._cond:
                while self._busy:
                    self._cond.wait()
                if upto is None:
                    self._queued = False
                self._check()
                start, stop = self.hashed, self.frontier
                if upto is not None and upto > stop:
                    raise MergeError(f"internal error: {upto} bytes to hash, {stop} written")
                if self._done or stop == start or (upto is None and stop - start < CHUNK):
                    return
                if upto is not None and start >= upto:
                    return
                self._busy = True
            try:
                _hash_fd(self._h, self._fd, start, stop)
            except BaseException as exc:
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._busy = False
                    if self._error is None:
                        self.hashed = stop
                    self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise MergeError(f"the output could not be hashed: {self._error}")


# open output file descriptor -> the hash its writes feed (`hashing`)
_HASHES: dict[int, FileHash] = {}
_LOCK = threading.Lock()


@contextmanager
def hashing(fd: int, h: FileHash | None) -> Iterator[None]:
    """Within the block every byte `io.copy` writes to `fd` is told to `h` (None: nothing)."""
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


class Digests(dict[str, "FileHash | str"]):
    """Each output file's hash as it is written, or its digest already known (a file a
    resumed merge kept), all of one `algo` (the manifest's)."""

    def __init__(self, algo: str = DEFAULT) -> None:
        super().__init__()
        self.algo = algo

    def start(self, name: str, path: Path) -> FileHash:
        """The hash of the output file `name` at `path`, just created."""
        h = FileHash(path, self.algo)
        self[name] = h
        return h

    def digest(self, name: str, size: int) -> str:
        """The digest of `name` (`size` bytes, all written)."""
        value = self[name]
        return value if isinstance(value, str) else value.hexdigest(size)

    def close(self) -> None:
        """A write that failed or was discarded: every hash still open let go."""
        for value in self.values():
            if isinstance(value, FileHash):
                value.close()
