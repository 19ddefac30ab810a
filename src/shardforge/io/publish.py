"""Nothing lost: write into a hidden temporary sibling, publish it with one rename at the end,
clean up on any error, SIGTERM or Ctrl-C.

Publishing re-checks the output path at the rename: without `overwrite` the rename never
replaces anything (`renameat2(RENAME_NOREPLACE)`; a plain `rename` of a directory fails on a
non-empty one; a file is published with `link`, which fails on any existing name), so of two
merges to one path exactly one publishes, and a file written into the output directory while
the merge ran is kept. With `overwrite` an existing directory is swapped atomically
(`RENAME_EXCHANGE`) and the previous one removed; a merge's output (`model_only`) replaces a
directory only while it holds a model and nothing else (`io.model_files`), checked before
anything is read and again at the rename.

The temporary name records its owner (boot, pid, process start time):
`.NAME.tmp-BOOT-PID-START-XXXX`. One left by a merge that was killed (`kill -9`) is removed by
the next merge to the same path once its owner is gone; a live merge's is never touched.

Every `OSError` of the output side (disk full, file too large, read-only file system, no
permission, a parent that cannot be created) becomes one `MergeError` line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from shardforge.errors import MergeError, ResumeRefused
from shardforge.io.fs import fsync_dir, fsync_file, fsync_tree
from shardforge.io.model_files import check_model_folder
from shardforge.io.pins import check_and_release as check_pins

log = logging.getLogger("shardforge")

# free space kept in reserve beyond the planned output size
DISK_MARGIN = 16 << 20
# renameat2 flags (linux/fs.h)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# characters of the output name kept in a temporary name (the rest of NAME_MAX is the owner)
_NAME_KEPT = 120
# errors that can only come from writing (the output side), whatever the file
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
_TEMP = re.compile(
    r"^\.(?P<name>.+)\.(?:tmp|old)-(?:(?P<boot>[0-9a-f]*)-(?P<pid>\d+)-(?P<start>\d+)-[^-/]+"
    r"|(?P<legacy>\d+))$"
)


# ---------------------------------------------------------------------------------------------
# owners of temporary names


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip().replace("-", "")[:8]
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None when it does not exist. 0 where
    the system has no /proc (then any live process with that pid counts as the owner)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])  # a zombie is gone
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _owner() -> str:
    pid = os.getpid()
    return f"{_boot_id()}-{pid}-{_start_time(pid) or 0}"


def _owner_gone(match: re.Match[str]) -> bool:
    if match["legacy"] is not None:  # `.NAME.tmp-PID` of an older shardforge
        return _start_time(int(match["legacy"])) is None
    if match["boot"] != _boot_id():
        return True
    start = _start_time(int(match["pid"]))
    return start is None or (start != 0 and start != int(match["start"]))


def _prefix(out: Path) -> str:
    return f".{out.name[:_NAME_KEPT]}"


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove the temporary siblings of `out` left by merges whose process is gone."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return removed
    prefix = _prefix(out)
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None or f".{m['name']}" != prefix or not _owner_gone(m):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        log.info("removed %s, left by an interrupted merge", path)
        removed.append(path)
    return removed


def _fresh_temp_sibling(out: Path, tag: str = "tmp", resume: bool = False) -> Path:
    """A new empty hidden directory beside `out`, named after its owner (stale ones of a
    killed merge are removed first). With `resume`, the newest stale directory of a killed
    merge to `out` is taken over instead (renamed to this owner's name), when there is one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    left = _newest_stale_dir(out) if resume else None
    if left is not None:
        taken = _new_temp_dir(out, tag)
        os.rename(left, taken)  # `taken` is an empty directory: the rename replaces it
        log.info("resuming the interrupted merge to %s", out)
    remove_stale_temps(out)
    if left is not None:
        return taken
    return _new_temp_dir(out, tag)


def _new_temp_dir(out: Path, tag: str) -> Path:
    """A new private directory beside `out`, named after its owner (as `tempfile.mkdtemp`
    makes it), removed again when a signal (SIGTERM, Ctrl-C) lands the moment it is made,
    before the caller's cleanup knows it."""
    while True:
        path = out.parent / f"{_prefix(out)}.{tag}-{_owner()}-{os.urandom(4).hex()}"
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
        except BaseException as exc:
            if not isinstance(exc, OSError):  # an interrupt: made or not, it is not kept
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise


def _newest_stale_dir(out: Path) -> Path | None:
    """The most recently changed temporary directory of a merge to `out` whose owner is gone."""
    found: list[tuple[float, Path]] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(out.parent):
            m = _TEMP.match(entry.name)
            if (
                m is not None
                and f".{m['name']}" == _prefix(out)
                and ".tmp-" in entry.name
                and entry.is_dir(follow_symlinks=False)
                and _owner_gone(m)
            ):
                found.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
    return max(found)[1] if found else None


# ---------------------------------------------------------------------------------------------
# checks before anything is read


def check_output_path(
    out: Path, overwrite: bool, inputs: list[Path], non_model: bool = False
) -> None:
    """Refuse an output that exists (unless overwrite) or overlaps the checkpoint; with
    overwrite, one that holds more than a model (unless `non_model`: `io.model_files`)."""
    for src in inputs:
        s, o = src.resolve(), out.resolve()
        if o == s or o.is_relative_to(s) or s.is_relative_to(o):
            raise MergeError(
                f"{out}: the output path overlaps the checkpoint {src}; choose another directory"
            )
    if out.exists():
        if not out.is_dir():
            raise MergeError(f"{out}: exists and is not a directory; choose another output path")
        if any(out.iterdir()):
            if not overwrite:
                raise MergeError(
                    f"{out}: output directory exists and is not empty; pass --overwrite to "
                    "replace it"
                )
            if not non_model:
                check_model_folder(out)


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


# ---------------------------------------------------------------------------------------------
# the rename


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """`renameat2(src, dst, flags)`; False where the system or file system lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _appeared(out: Path) -> MergeError:
    return MergeError(
        f"{out}: appeared while the merge ran (another merge or program wrote it); nothing was "
        "replaced and this merge's output was discarded - choose another output path, or pass "
        "--overwrite to replace it"
    )


def _publish_dir(tmp: Path, out: Path, overwrite: bool, model_only: bool = False) -> None:
    """Rename `tmp` to `out`; without `overwrite` only if `out` is absent or an empty
    directory, decided atomically at the rename; with `model_only` a directory that holds
    more than a model is refused (what appeared there while the merge ran counts)."""
    if overwrite and out.is_dir() and not out.is_symlink():
        if model_only:
            check_model_folder(out)
        if _renameat2(tmp, out, RENAME_EXCHANGE):
            shutil.rmtree(tmp, ignore_errors=True)  # now the previous output
            return
        old = Path(tempfile.mkdtemp(prefix=f"{_prefix(out)}.old-{_owner()}-", dir=out.parent))
        os.rename(out, old)  # `old` is an empty directory: rename replaces it
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)  # put the previous output back
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        try:
            os.rmdir(out)  # empty when checked at the start; not if a file appeared since
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _appeared(out) from None
            raise
    try:
        if not _renameat2(tmp, out, RENAME_NOREPLACE):
            os.rename(tmp, out)  # fails on a non-empty directory or a file
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _appeared(out) from None
        raise


def _publish_file(written: Path, out: Path, overwrite: bool) -> None:
    """Make `written` the file `out`; without `overwrite` only if no `out` exists then."""
    if overwrite:
        if out.is_dir():
            raise _appeared(out)
        os.replace(written, out)
        return
    try:
        os.link(written, out)  # fails if anything named `out` exists
    except FileExistsError:
        raise _appeared(out) from None
    except OSError as exc:  # a file system without hard links
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        try:
            if not _renameat2(written, out, RENAME_NOREPLACE):
                if os.path.lexists(out):
                    raise _appeared(out) from None
                os.rename(written, out)
        except FileExistsError:
            raise _appeared(out) from None


# ---------------------------------------------------------------------------------------------
# errors of the output side


def _inside(name: object, folders: tuple[Path, ...]) -> bool:
    if not isinstance(name, str | bytes | os.PathLike):
        return False
    path = Path(os.fsdecode(name)).absolute()
    return any(path == f or path.is_relative_to(f) for f in folders)


def output_error(exc: OSError, out: Path, tmp: Path | None = None) -> MergeError | None:
    """The one-line error for an OSError of the output side (None: it is not one)."""
    folders = tuple(p.absolute() for p in (out, out.parent, *([tmp] if tmp else [])))
    ours = exc.errno in _WRITE_ERRNOS or (
        exc.filename is not None and _inside(exc.filename, folders)
    )
    if not ours:
        return None
    where = out.parent if exc.errno in (errno.ENOSPC, errno.EDQUOT) else out
    if exc.filename is not None and exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        where = Path(os.fsdecode(exc.filename))
        temp = where.absolute().parent == out.absolute().parent and _TEMP.match(where.name)
        if temp or (tmp is not None and _inside(exc.filename, (tmp.absolute(),))):
            where = out  # the temporary name means nothing to the user
    reason = {
        errno.ENOSPC: "no space left on the device while writing the merged model; free space "
        "or choose another --output_path",
        errno.EDQUOT: "disk quota exceeded while writing the merged model; free space or choose "
        "another --output_path",
        errno.EFBIG: "file too large (a file-size limit, `ulimit -f`, or the file system's "
        "largest file); choose another --output_path or a smaller --max_shard_size",
        errno.EROFS: "read-only file system; choose an --output_path on a writable one",
        errno.EACCES: "permission denied; choose an --output_path you can write",
        errno.EPERM: "operation not permitted; choose an --output_path you can write",
        errno.ENOENT: "no such file or directory (was the output's folder removed?)",
        errno.ENOTDIR: "a part of the output path is a file, not a directory",
    }.get(exc.errno or 0, f"{exc.strerror or exc}; the merged model was not written")
    return MergeError(f"{where}: {reason}")


@contextmanager
def _output_errors(out: Path, tmp: Path | None = None) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        converted = output_error(exc, out, tmp)
        if converted is None:
            raise
        raise converted from exc


# ---------------------------------------------------------------------------------------------
# the atomic outputs


def current_umask() -> int:
    """The process's umask (read from /proc where it is shown, so no other thread ever sees
    it changed; else set and restored at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """The mode open() gives a new file under the umask, for a file written by a library that
    creates it private (safetensors' `save_file`: rw-------)."""
    os.chmod(path, 0o666 & ~current_umask())


def _as_umask_allows(tmp: Path) -> None:
    """The mode a directory made with mkdir would have: the temporary sibling is private
    (mkdtemp: 0o700) while it is written; the published folder follows the umask."""
    os.chmod(tmp, 0o777 & ~current_umask())


@contextmanager
def atomic_directory(
    out: Path, overwrite: bool = False, resume: bool = False, model_only: bool = False
) -> Iterator[Path]:
    """Yield a temporary directory beside `out` (private while written); on success it becomes
    `out` (with the mode the umask gives a new directory; replacing a previous one only with
    `overwrite`, and with `model_only` only one that holds a model and nothing else), on any
    exception it is removed and `out` is left as it was. With `resume`, the directory a killed
    merge to `out` left is yielded (with what it wrote) when there is one."""
    with _output_errors(out):
        tmp = _fresh_temp_sibling(out, resume=resume)
    try:
        with _output_errors(out, tmp):
            yield tmp
            check_pins()  # every input still the version read (io.pins)
            fsync_tree(tmp)  # every file (index, config, tokenizer too) before it is visible
            _as_umask_allows(tmp)
            _publish_dir(tmp, out, overwrite, model_only)
            fsync_dir(out.parent)
    except ResumeRefused:  # the finished files stay, for a later --resume (or removal)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success the file `out.name` written in it
    becomes `out` (replacing a previous one only with `overwrite`), on any exception the
    directory is removed and `out` is left as it was."""
    with _output_errors(out):
        tmp = _fresh_temp_sibling(out)
    try:
        with _output_errors(out, tmp):
            yield tmp
            check_pins()  # every input still the version read (io.pins)
            follow_umask(tmp / out.name)
            fsync_file(tmp / out.name)
            _publish_file(tmp / out.name, out, overwrite)
            fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs, and ignore SIGXFSZ so a file-size
    limit is an error (EFBIG) rather than a kill (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGXFSZ, xfsz)
