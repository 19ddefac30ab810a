"""Output files written from aligned windows in memory with O_DIRECT: a merged file's bytes
never pass through its page cache.

Why (issue 36, measured in benchmarks/README): `copy_file_range` into the output's page cache
cost about 1.1 CPU-s per GB cold on two cores (the kernel's copy, the dirty pages' writeback),
and the manifest's hash then read the written bytes back from there. Written with O_DIRECT,
the bytes go from one buffer of ours to the disk (no copy, no writeback), and the hash reads
that buffer while it is hot.

How: the output file is cut into `WINDOW`-byte windows (whole pages). Every write to the file
(`io.copy.copy_range`'s slabs of data files, `pwrite_all`'s bytes from memory) lands in the
buffer of the window it covers; a slab is read straight into place (`preadv` from the input's
page cache, which `io.copy.copy_jobs` asks of the kernel ahead). Reading a cold input with
O_DIRECT instead was measured and dropped: one thread's synchronous reads lost to the kernel's
read-ahead on a one-file 4 GB checkpoint (7.8 s against 5.7 s), and were no faster on 8 GB
(benchmarks/README, "O_DIRECT"). A window whose every byte is in
memory is handed to the file's hash when it comes next in the file's order
(`FileHash.absorb`) and written by a writer thread (`WRITERS`): its whole pages with O_DIRECT,
the file's last partial page through the page cache.

At most `MAX_WINDOWS` buffers exist per output (a writer waits for one to be written). A window
that cannot be completed in memory (part of it written before this object, e.g. by the early
copy; the oldest one when the buffers are all taken; whatever is left at `finish`) is written
through the page cache instead and told to the hash as before (`FileHash.written`, which reads
it back from there): correct, at the old speed. A file system that refuses O_DIRECT gets plain
writes (`writes_to` falls back to the hash alone); `SHARDFORGE_DIRECT_IO=0` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from shardforge.errors import MergeError
from shardforge.io.digest import FileHash, hashing
from shardforge.io.files import read_exact_into

ALIGN = 4096  # O_DIRECT's unit here: offsets, lengths and buffer addresses are multiples
WINDOW = 2 << 20  # bytes of the output per window (a multiple of ALIGN)
MAX_WINDOWS = 6  # window buffers per output at once
WRITERS = 2  # O_DIRECT writes in flight per output
# what a file system that takes O_DIRECT at open but not for a write answers
REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
ENV = "SHARDFORGE_DIRECT_IO"  # "0": every output through the page cache

# windows' states
FILLING, READY, HASHING, WRITING = "filling", "ready", "hashing", "writing"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and hasattr(os, "O_DIRECT")


class _Window:
    """Bytes [start, end) of the output, gathered in `buf` (`ranges` filled so far)."""

    __slots__ = ("buf", "end", "filled", "index", "ranges", "start", "state", "users")

    def __init__(self, index: int, start: int, end: int, buf: mmap.mmap) -> None:
        self.index, self.start, self.end, self.buf = index, start, end, buf
        self.filled = 0
        self.ranges: list[tuple[int, int]] = []
        self.state = FILLING
        self.users = 0  # writers copying into it right now

    @property
    def complete(self) -> bool:
        return self.filled == self.end - self.start


def _name(fd: int) -> str:
    """The path of the open file `fd`, for an error line."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "a data file"


def _reopen(fd: int, flags: int) -> int | None:
    """The file open at `fd` opened again with `flags` (O_DIRECT), the same file for sure
    (device and inode compared); None where it cannot be."""
    try:
        new = os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(new)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        os.close(new)
        return None
    return new


def pwrite_whole(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` at `offset` of `fd` (several calls where the kernel takes fewer)."""
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class DirectOutput:
    """The writes to one output file (`fd`, `size` bytes), gathered into windows and written
    with O_DIRECT through `dfd` (see the module docstring); `h`: its hash, or None. Writes
    from any thread; `finish` (or `abort`) once, when they are done."""

    def __init__(self, fd: int, dfd: int, size: int, h: FileHash | None) -> None:
        self._fd, self._dfd, self.size, self._h = fd, dfd, size, h
        self._cond = threading.Condition()
        self._windows: dict[int, _Window] = {}
        self._spilled: set[int] = set()  # windows written through the page cache
        self._free: list[mmap.mmap] = []
        self._buffers = 0  # buffers allocated (at most MAX_WINDOWS)
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="shardforge-direct")
        self._error: BaseException | None = None
        self._direct = True  # False once the file system refused an O_DIRECT write

    # --- what the writers call ------------------------------------------------------

    def put(self, offset: int, data: memoryview) -> None:
        """`data` (bytes) is the file's bytes at `offset`."""

        def fill(view: memoryview, at: int) -> None:
            view[:] = data[at : at + len(view)]

        self._each(offset, len(data), fill)

    def copy_from(self, src: int, src_offset: int, offset: int, n: int) -> None:
        """The `n` bytes at `src_offset` of the input `src` are the file's bytes at `offset`."""

        def fill(view: memoryview, at: int) -> None:
            read_exact_into(src, view, src_offset + at, name)

        name = _name(src)  # (once per copy: a system call costs a turn of the GIL)

        self._each(offset, n, fill)

    def _each(self, offset: int, n: int, fill: Callable[[memoryview, int], None]) -> None:
        """Bytes [offset, offset + n), window by window: into its buffer, or (a window written
        through the page cache) written so at once."""
        if offset < 0 or offset + n > self.size:
            raise MergeError(f"internal error: a write at {offset} past the file's {self.size}")
        at = offset
        while at < offset + n:
            index = at // WINDOW
            stop = min(offset + n, (index + 1) * WINDOW)
            w = self._acquire(index)
            if w is None:
                data = memoryview(bytearray(stop - at))
                fill(data, at - offset)
                self._plain(at, data)
            else:
                try:
                    fill(memoryview(w.buf)[at - w.start : stop - w.start], at - offset)
                except BaseException:
                    with self._cond:  # (its bytes are not there: the window never completes)
                        w.users -= 1
                        self._cond.notify_all()
                    raise
                self._filled(w, at, stop)
            at = stop

    # --- windows --------------------------------------------------------------------

    def _acquire(self, index: int) -> _Window | None:
        """The window `index`, one more writer in it (None: it goes through the page cache);
        made when new, once a buffer is free."""
        with self._cond:
            while True:
                self._check()
                if index in self._spilled:
                    return None
                w = self._windows.get(index)
                if w is not None:
                    w.users += 1
                    return w
                buf = self._buffer()
                if buf is not None:
                    start = index * WINDOW
                    w = _Window(index, start, min(self.size, start + WINDOW), buf)
                    w.users = 1
                    self._windows[index] = w
                    return w
                victim = self._victim()
                if victim is None:
                    self._cond.wait()
                    continue
                self._cond.release()  # spilled outside the lock (it writes)
                try:
                    self._spill(victim)
                finally:
                    self._cond.acquire()

    def _buffer(self) -> mmap.mmap | None:
        """A free window buffer (page-aligned: an anonymous mapping), None when all are taken."""
        if self._free:
            return self._free.pop()
        if self._buffers < MAX_WINDOWS:
            self._buffers += 1
            return mmap.mmap(-1, WINDOW)
        return None

    def _victim(self) -> _Window | None:
        """When every buffer is taken: the first window in the file's order nobody is copying
        into and no writer holds (it goes through the page cache), unless a write will free a
        buffer anyway (None: wait)."""
        if any(w.state in (HASHING, WRITING) for w in self._windows.values()):
            return None
        idle = [w for w in self._windows.values() if w.users == 0 and w.state in (FILLING, READY)]
        return self._taken(min(idle, key=lambda x: x.index)) if idle else None

    def _taken(self, w: _Window) -> _Window:
        """(Lock held.) `w` is to go through the page cache: from now on, so do later writes
        into its range (none lands in a buffer being written out)."""
        w.state = HASHING
        self._spilled.add(w.index)
        return w

    def _filled(self, w: _Window, start: int, stop: int) -> None:
        with self._cond:
            w.users -= 1
            w.filled += stop - start
            w.ranges.append((start, stop))
            if w.complete and w.state == FILLING:
                w.state = READY
            self._cond.notify_all()
        self._advance()

    def _advance(self) -> None:
        """Hash (from memory) and write every complete window whose turn in the file's order
        has come."""
        while True:
            with self._cond:
                w = self._next_ready()
                if w is None:
                    return
                w.state = HASHING
            if not self._absorbed(w):
                with self._cond:
                    self._taken(w)
                self._spill(w)  # (not its turn after all)
                continue
            with self._cond:
                w.state = WRITING
                self._pool.submit(self._write, w)

    def _absorbed(self, w: _Window) -> bool:
        """Whether the hash took `w` from memory (or there is none); an error of the hash is
        every writer's (the window freed: nobody waits for it)."""
        try:
            return self._h is None or self._h.absorb(w.start, memoryview(w.buf)[: w.end - w.start])
        except BaseException as exc:
            with self._cond:
                self._error = self._error or exc
                self._release(w)
            raise

    def _next_ready(self) -> _Window | None:
        ready = [w for w in self._windows.values() if w.state == READY]
        if self._h is None:
            return ready[0] if ready else None
        frontier = self._h.frontier
        return next((w for w in ready if w.start == frontier), None)

    def _spill(self, w: _Window) -> None:
        """Write what `w` holds through the page cache (`_taken`) and free it."""
        try:
            for a, b in sorted(w.ranges):
                pwrite_whole(self._fd, memoryview(w.buf)[a - w.start : b - w.start], a)
            if self._h is not None:
                for a, b in w.ranges:
                    self._h.written(a, b - a)
        finally:
            with self._cond:
                self._release(w)
        self._advance()

    def _plain(self, offset: int, data: memoryview) -> None:
        """Bytes of a window that went through the page cache: written there, then hashed."""
        pwrite_whole(self._fd, data, offset)
        if self._h is not None:
            self._h.written(offset, len(data))
        self._advance()

    def _write(self, w: _Window) -> None:
        """On a writer thread: `w`'s whole pages with O_DIRECT, a last partial page (the
        file's end) through the page cache."""
        try:
            n = w.end - w.start
            whole = n - n % ALIGN
            view = memoryview(w.buf)
            if whole and self._direct:
                try:
                    pwrite_whole(self._dfd, view[:whole], w.start)
                except OSError as exc:
                    if exc.errno not in REFUSED:
                        raise
                    self._direct = False  # refused here: the page cache from now on
            if whole and not self._direct:
                pwrite_whole(self._fd, view[:whole], w.start)
            if whole < n:
                pwrite_whole(self._fd, view[whole:n], w.start + whole)
        except BaseException as exc:
            with self._cond:
                self._error = self._error or exc
        finally:
            with self._cond:
                self._release(w)

    def _release(self, w: _Window) -> None:
        """(Lock held.) `w` is written: its buffer free again."""
        del self._windows[w.index]
        self._free.append(w.buf)
        self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # --- the end --------------------------------------------------------------------

    def finish(self) -> None:
        """Every byte of the file was handed over: what is still in memory goes through the
        page cache (in the file's order); returns once all is written (the first error
        raised)."""
        self._advance()
        while True:
            with self._cond:
                self._check()
                left = [w for w in self._windows.values() if w.state in (FILLING, READY)]
                if not left:
                    break
                w = self._taken(min(left, key=lambda x: x.index))
            self._spill(w)
        self._close(cancel=False)
        self._check()

    def abort(self) -> None:
        """The file is discarded: the writes in flight end, nothing more is written (a writer
        still at work, e.g. a cast thread an interrupt left running, gets an error)."""
        with self._cond:
            self._error = self._error or MergeError(
                "internal error: a write after its file was discarded"
            )
            self._cond.notify_all()
        self._close(cancel=True)

    def _close(self, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)


# open output file descriptor -> its `DirectOutput` (`writes_to`)
_OUTPUTS: dict[int, DirectOutput] = {}
_LOCK = threading.Lock()


def direct_of(fd: int) -> DirectOutput | None:
    """The `DirectOutput` that writes to the output `fd` go through, if any."""
    return _OUTPUTS.get(fd)


@contextmanager
def writes_to(fd: int, size: int, h: FileHash | None) -> Iterator[None]:
    """Within the block, every byte `io.copy` writes to the output file `fd` (`size` bytes)
    goes through a `DirectOutput` where the file system takes O_DIRECT (else straight to the
    file), and its hash `h` (None: none) is told of it; on leaving, all is written."""
    with hashing(fd, h):
        dfd = _reopen(fd, os.O_WRONLY | os.O_DIRECT) if enabled() else None
        if dfd is None:
            yield
            return
        out = DirectOutput(fd, dfd, size, h)
        with _LOCK:
            _OUTPUTS[fd] = out
        try:
            yield
            out.finish()
        except BaseException:
            out.abort()
            raise
        finally:
            with _LOCK:
                _OUTPUTS.pop(fd, None)
            with contextlib.suppress(OSError):
                os.close(dfd)
