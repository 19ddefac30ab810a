"""One writer at a time for an output: a lock file that names its holder.

    with output_lock(lock_beside(out), out, "merge-sharded-fsdp-weights", take_over=False):
        ...  # write and publish `out`

The lock file (`<output>.shardforge.lock` beside a merge's output, `.shardforge.lock` inside a
run's output_dir) holds one JSON line: the host, the pid and its start time, the boot, when,
and the command. It is held with `fcntl.flock` on this host and removed on exit; the kernel
lets the flock go when its process dies in any way (SIGKILL included), so a file left behind
names a writer that is gone. Taking it:

- flock refused: another process holds it: one error naming that holder;
- the file names a process of this host (same boot) that still runs with the start time it
  recorded: refused likewise (it holds the output by other means than this flock);
- it names a process of this host that is gone (no such pid, another start time: the pid was
  reused, another boot): taken over, with a notice;
- it names another host: refused unless `take_over` (that host's process may still run: a
  network file system does not always carry a flock across hosts), then taken over with a
  notice; an empty file is one whose writer died before it wrote: taken over; a damaged one
  (not a lock line, a pid out of range) is taken over with a notice that says so.

The lock file is a file of its own: one that is a symbolic link, a FIFO or anything but a
regular file is refused, in an error naming it (never followed, never waited on: it is
checked before and after a non-blocking open); one that is a hard link to another file is
replaced by a file of its own (the other file keeps its content), never written through.

A file system without flock (some network ones answer ENOLCK) is said in a warning; there the
file's contents alone keep writers apart (two started at the same moment are not).

Object storage has no flock: an s3:// output is not locked here (docs/storage.md).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from shardforge.errors import ShardforgeError, printable

log = logging.getLogger("shardforge")

LOCK_SUFFIX = ".shardforge.lock"
LOCK_NAME = ".shardforge.lock"
# what is read of a lock file (it is one short JSON line)
MAX_LOCK_BYTES = 4096
# the largest pid a lock line may name (Linux's PID_MAX_LIMIT is 2**22; pid_t is 32 bits)
MAX_PID = (1 << 31) - 1
# how long a lock whose holder has ended may stay flocked (its last threads exiting)
EXITING_S = 5.0


# the error a caller gives for an OSError of making the lock file (None: the generic one)
Unusable = Callable[[OSError], ShardforgeError | None]


class OutputLocked(ShardforgeError):
    """Another writer holds the output (its lock file names it)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file."""

    host: str
    pid: int
    start: str | None  # the process's start time (/proc/PID/stat, clock ticks since boot)
    boot: str | None  # this boot's id (/proc/sys/kernel/random/boot_id)
    since: str  # when it took the lock (UTC, ISO 8601)
    command: str

    def describe(self) -> str:
        """`COMMAND (pid N on HOST, since TIME)`, printable and short (a lock file is read as
        untrusted input: another process wrote it)."""
        command, host = printable(self.command)[:80], printable(self.host)[:60]
        return f"{command} (pid {self.pid} on {host}, since {printable(self.since)[:40]})"


def lock_beside(output: Path) -> Path:
    """The lock file of an output path (a directory or a file): `<output>.shardforge.lock`."""
    return output.parent / f"{output.name}{LOCK_SUFFIX}"


def lock_inside(folder: Path) -> Path:
    """The lock file of a folder written in place (a run's output_dir)."""
    return folder / LOCK_NAME


def me(command: str) -> Holder:
    pid = os.getpid()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return Holder(socket.gethostname(), pid, _start_time(pid), _boot_id(), now, command)


@contextlib.contextmanager
def output_lock(
    lock: Path,
    output: Path | str,
    command: str,
    take_over: bool = False,
    option: str = "",
    unusable: Unusable | None = None,
) -> Iterator[Holder]:
    """Hold `lock` for writing `output` in the block (see the module's doc); `option` is how the
    user says `take_over` (named in the refusal of another host's lock). A lock file that
    cannot be made (a parent that is a file, a read-only file system) is the error
    `unusable(exc)` gives for the OSError (its file named as `output`), else a generic one."""
    holder = me(command)
    fd = _take(lock, output, holder, take_over, option, unusable)
    try:
        yield holder
    finally:
        _release(lock, fd)


def _take(
    lock: Path,
    output: Path | str,
    holder: Holder,
    take_over: bool,
    option: str,
    unusable: Unusable | None,
) -> int:
    for _ in range(10):  # the file was removed or replaced between open and flock: again
        try:
            fd = _open(lock, output)
        except OSError as exc:
            raise _unusable(lock, output, exc, unusable) from None
        try:
            _flock_unless_running(fd, output)
        except OSError:
            previous = _read(fd)
            os.close(fd)
            raise _held(output, lock, previous, "it is running") from None
        try:
            if _same_file(fd, lock) and not _unlinked_if_shared(fd, lock, output):
                damaged = _read(fd) is None and os.fstat(fd).st_size > 0
                _judge(lock, output, _read(fd), take_over, option, damaged)
                _write(fd, holder)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OutputLocked(
        f"{output}: its lock file {lock} keeps changing; is another writer starting?"
    )


def _flock_unless_running(fd: int, output: Path | str) -> None:
    """`_flock`; while the holder the file names is a process of this host that has ended (a
    killed process's last threads still exiting hold its files for a moment after it shows as
    a zombie), tried again for up to `EXITING_S`. OSError: a running process holds it."""
    deadline = time.monotonic() + EXITING_S
    while True:
        try:
            _flock(fd, output)
            return
        except OSError:
            previous, here = _read(fd), me("")
            ended = previous is not None and previous.host == here.host
            ended = ended and previous is not None and not _runs(previous, here)
            if not ended or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _flock(fd: int, output: Path | str) -> None:
    """flock the lock file; OSError: another process holds it. A file system without flock
    (ENOLCK, EOPNOTSUPP, ...) is said once: the lock file's contents alone keep writers apart
    there (a running writer of this host is still refused)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        log.warning(
            "warning: %s: its file system cannot lock files (%s); two writers started at once "
            "are not kept apart",
            output,
            exc.strerror or exc,
        )


def _open(lock: Path, output: Path | str) -> int:
    """The lock file, created (with its folder: an output's parent is made as publishing makes
    it) if missing; refused, naming it, when it is not a regular file (checked before the
    open, which neither follows a link nor waits on a FIFO, and after it)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        _check_kind(os.lstat(lock).st_mode, lock, output)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(lock, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # made a symbolic link since the check
            _check_kind(stat.S_IFLNK, lock, output)
        raise
    try:
        _check_kind(os.fstat(fd).st_mode, lock, output)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_kind(mode: int, lock: Path, output: Path | str) -> None:
    """Refuse a lock file that is not a regular file, naming it."""
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    )
    kind = next((name for test, name in kinds if test(mode)), "a device or special file")
    raise ShardforgeError(
        f"{lock}: this lock file of {Path(output).name} is {kind}, not a file shardforge "
        "wrote; remove it (shardforge writes one of its own there)"
    )


def _unlinked_if_shared(fd: int, lock: Path, output: Path | str) -> bool:
    """A lock file with other names (a hard link to another file) is never written through:
    its name is removed (the other file keeps its content) and a file of its own made instead.
    True when it was."""
    if os.fstat(fd).st_nlink <= 1:
        return False
    log.warning(
        "warning: %s: its lock file %s is a hard link to another file; replacing it with a "
        "lock file of its own (the other file is left as it is)",
        output,
        lock,
    )
    os.unlink(lock)
    return True


def _unusable(
    lock: Path, output: Path | str, exc: OSError, unusable: Unusable | None
) -> ShardforgeError:
    if unusable is not None:
        named = str(output) if exc.filename in (str(lock), lock) else exc.filename
        error = unusable(OSError(exc.errno, exc.strerror, named))
        if error is not None:
            return error
    return ShardforgeError(
        f"{output}: cannot take its lock file {lock}: {exc.strerror or exc}; check that the "
        "folder is writable"
    )


def _same_file(fd: int, lock: Path) -> bool:
    """The locked file is still the one at `lock` (a holder that let go removed its file)."""
    try:
        at = os.stat(lock, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at.st_dev, at.st_ino)


def _judge(
    lock: Path,
    output: Path | str,
    previous: Holder | None,
    take: bool,
    option: str,
    damaged: bool = False,
) -> None:
    """Raise unless the lock file's previous holder (if any) may be taken over; say so when it
    is (and when the file holds no lock line that can be read: no writer holds it, the flock
    is ours)."""
    if previous is None:
        if damaged:
            log.warning(
                "warning: %s: its lock file %s holds no lock line shardforge can read "
                "(damaged); taking it over",
                output,
                lock,
            )
        return
    here = me("")
    if previous.host == here.host:
        if _runs(previous, here):
            raise _held(output, lock, previous, "it is running and holds the output")
        log.warning(
            "warning: %s: taking over the lock of a writer that has ended: %s",
            output,
            previous.describe(),
        )
        return
    if not take:
        how = f"; if it no longer runs, pass {option} to take the output over" if option else ""
        raise _held(
            output, lock, previous, f"on another host: shardforge cannot tell whether it runs{how}"
        )
    log.warning("warning: %s: taking over the lock of %s (%s)", output, previous.describe(), option)


def _runs(holder: Holder, here: Holder) -> bool:
    """Whether the holder (a process of this host) still runs: same boot, its pid alive, with
    the start time it recorded (else the pid was reused)."""
    if holder.boot and here.boot and holder.boot != here.boot:
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    start = _start_time(holder.pid)
    if start is None:  # gone meanwhile, a zombie, or no /proc: alive unless it is gone
        return sys.platform != "linux" and holder.start is None
    return holder.start is None or holder.start == start


def _held(output: Path | str, lock: Path, holder: Holder | None, why: str) -> OutputLocked:
    who = holder.describe() if holder is not None else "another shardforge process (starting)"
    return OutputLocked(f"{output}: in use by {who}: {why}", [f"lock file: {lock}"])


def _read(fd: int) -> Holder | None:
    """The holder a lock file names; None when it names none (empty, or not a lock line)."""
    try:
        data = json.loads(os.pread(fd, MAX_LOCK_BYTES, 0).decode("utf-8"))
        pid = data["pid"]
        if type(pid) is not int or not 0 < pid <= MAX_PID:  # kill(0 or -1) would signal many
            return None
        return Holder(
            host=str(data["host"]),
            pid=pid,
            start=None if data.get("start") is None else str(data["start"]),
            boot=None if data.get("boot") is None else str(data["boot"]),
            since=str(data.get("since", "?")),
            command=str(data.get("command", "?")),
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def _write(fd: int, holder: Holder) -> None:
    data = (json.dumps(asdict(holder)) + "\n").encode("utf-8")
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _release(lock: Path, fd: int) -> None:
    """Remove the lock file (still ours: it is flocked by `fd`), then let the flock go."""
    try:
        if _same_file(fd, lock):
            with contextlib.suppress(OSError):
                os.unlink(lock)
    finally:
        os.close(fd)


def _start_time(pid: int) -> str | None:
    """Linux: the process's start time (clock ticks after boot; field 22 of /proc/PID/stat);
    None where there is none (no such process, or no /proc). A zombie has none either."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return fields[19]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return None
