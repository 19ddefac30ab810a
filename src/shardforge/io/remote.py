"""Object storage (S3 and S3-compatible stores) as bytes: URIs, a file system per endpoint and
credentials, errors in one line without secrets, and remote objects read by byte ranges.

    uri = RemoteURI.parse("s3://bucket/run/checkpoint-100")
    fs = filesystem(storage_options)          # s3fs; credentials from storage_options, else AWS_*
    obj = RemoteObject(fs, uri.child("__0_0.distcp"), size)
    obj.read_into(buffer, offset, label)      # ranged GETs, several at a time for large reads

A remote object stands in the local file tree as a sparse file of its size (`io.mirror`); the
file's identity is registered here (`register_stand_in`), and every read the byte path makes
through a descriptor of it (`pread`, `preadinto`, `io.files.read_exact_into`,
`io.copy.copy_range`) is served by ranged requests instead. Formats read through those
functions only, so they read a remote checkpoint unchanged, record bounds and CRCs checked as
for a local one. Memory: `PARALLEL` parts of `PART_BYTES` in flight for a large read, and
`CACHE_BLOCKS` blocks of `SMALL_BLOCK` for the small reads of record headers.

Nothing here imports s3fs until a remote path is used (the `s3` extra installs it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardforge.errors import CheckpointError, StorageError

SCHEME = "s3://"
# a large read is split into parts of this size, fetched `PARALLEL` at a time
PART_BYTES = 8 << 20
PARALLEL = 8
# a read of at most `SMALL_READ` bytes fetches the aligned `SMALL_BLOCK` around it, cached
SMALL_READ = 64 << 10
SMALL_BLOCK = 256 << 10
CACHE_BLOCKS = 32
_URI = re.compile(r"^s3://(?P<bucket>[^/]+)(?:/(?P<key>.*))?$")


def is_remote(path: object) -> bool:
    """Whether `path` is an object-storage URI (``s3://bucket/...``)."""
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclass(frozen=True)
class RemoteURI:
    """``s3://bucket/key``: a bucket and a key prefix (no leading or trailing slash)."""

    bucket: str
    key: str = ""

    @classmethod
    def parse(cls, text: str) -> RemoteURI:
        m = _URI.match(text.strip())
        if m is None:
            raise StorageError(f"{text}: not an object-storage URI (expected s3://BUCKET/PREFIX)")
        return cls(m["bucket"], (m["key"] or "").strip("/"))

    def __str__(self) -> str:
        return f"{SCHEME}{self.path}"

    @property
    def path(self) -> str:
        """The file system's path: ``bucket/key``."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1] if self.key else self.bucket

    def child(self, name: str) -> RemoteURI:
        return RemoteURI(self.bucket, f"{self.key}/{name}" if self.key else name)

    def relative(self, path: str) -> str:
        """`path` (``bucket/key/...``) relative to this prefix."""
        return path[len(self.path) :].lstrip("/")


# ------------------------------------------------------------------------------ file system

# botocore's retries: a few, so that an outage is an error in seconds, not minutes
DEFAULT_CONFIG = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5}


def filesystem(storage_options: Mapping[str, Any] | None = None) -> Any:
    """An s3fs file system with `storage_options` (s3fs's keywords: key, secret, token,
    endpoint_url, client_kwargs, ...); credentials and endpoint not given there come from the
    usual AWS variables and files (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws)."""
    try:
        import s3fs
    except ImportError:
        raise StorageError("s3:// paths need s3fs: pip install 'shardforge[s3]'") from None
    for name in ("botocore", "aiobotocore", "s3fs"):  # their notices name endpoints and ids
        logging.getLogger(name).setLevel(logging.WARNING)
    options = dict(storage_options or {})
    config = {**DEFAULT_CONFIG, **dict(options.pop("config_kwargs", None) or {})}
    return s3fs.S3FileSystem(config_kwargs=config, **options)


def secrets(storage_options: Mapping[str, Any] | None) -> list[str]:
    """The secret values of `storage_options` and the environment (to redact from messages)."""
    from shardforge.config.schema import STORAGE_SECRET_KEYS

    found = [str(v) for k, v in (storage_options or {}).items() if k in STORAGE_SECRET_KEYS and v]
    found += [
        os.environ[k] for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN") if os.environ.get(k)
    ]
    return [s for s in found if len(s) >= 4]


def redact(text: str, hidden: list[str]) -> str:
    for value in hidden:
        text = text.replace(value, "***")
    return re.sub(r"(?i)(signature|credential|x-amz-security-token)=[^&\s]+", r"\1=***", text)


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:160] if lines else type(exc).__name__


def storage_error(exc: BaseException, where: str, hidden: list[str] | None = None) -> StorageError:
    """One line for a failed request at `where`: what went wrong and what to do."""
    reason = redact(_reason(exc), hidden or [])
    name = type(exc).__name__
    if isinstance(exc, PermissionError) or "AccessDenied" in reason or "signature" in reason:
        hint = "access denied ({}); check the credentials (storage_options key/secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
    elif isinstance(exc, FileNotFoundError) and "bucket" in reason.lower():
        hint = "no such bucket ({}); create it or fix the URI"
    elif isinstance(exc, FileNotFoundError):
        hint = "not found ({})"
    elif "connect" in (reason + name).lower() or isinstance(exc, ConnectionError | TimeoutError):
        hint = "the object store cannot be reached ({}); check the endpoint and that it is up"
    else:
        hint = (
            f"the request failed ({name}: {{}}); the store may be down or throttling - retry later"
        )
    return StorageError(f"{where}: {hint.format(reason)}")


@contextlib.contextmanager
def storage_errors(
    where: object, storage_options: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Turn a failed request inside the block into one `StorageError` line naming `where`."""
    try:
        yield
    except StorageError:
        raise
    except CheckpointError:
        raise
    except Exception as exc:
        raise storage_error(exc, str(where), secrets(storage_options)) from None


# ---------------------------------------------------------------------------- remote reads


class _BlockCache:
    """The last `CACHE_BLOCKS` small blocks read, by (object, block index)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int], fetch: Callable[[], bytes]) -> bytes:
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return self._blocks[key]
        data = fetch()
        with self._lock:
            self._blocks[key] = data
            while len(self._blocks) > CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return data


_CACHE = _BlockCache()


@dataclass(frozen=True)
class RemoteObject:
    """One object of the store, `size` bytes, read by byte ranges."""

    fs: Any
    uri: RemoteURI
    size: int
    storage_options: Mapping[str, Any] | None = None

    def _get(self, start: int, end: int) -> bytes:
        with storage_errors(self.uri, self.storage_options):
            return bytes(self.fs.cat_file(self.uri.path, start=start, end=end))

    def _block(self, index: int) -> bytes:
        """Block `index` of `SMALL_BLOCK` bytes, from the cache of recent small reads."""
        start = index * SMALL_BLOCK
        return _CACHE.get(
            (str(self.uri), index), lambda: self._get(start, min(self.size, start + SMALL_BLOCK))
        )

    def read(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset` (fewer only at the end of the object)."""
        end = min(self.size, offset + n)
        if end <= offset:
            return b""
        if end - offset <= SMALL_READ:
            first, last = offset // SMALL_BLOCK, (end - 1) // SMALL_BLOCK
            joined = b"".join(self._block(b) for b in range(first, last + 1))
            base = first * SMALL_BLOCK
            return joined[offset - base : end - base]
        return b"".join(data for _, data in self.ranges(offset, end - offset))

    def ranges(self, offset: int, n: int) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of [offset, offset + n), fetched `PARALLEL` parts at a time."""
        end = min(self.size, offset + n)
        starts = list(range(offset, end, PART_BYTES))
        for i in range(0, len(starts), PARALLEL):
            batch = starts[i : i + PARALLEL]
            ends = [min(end, s + PART_BYTES) for s in batch]
            with storage_errors(self.uri, self.storage_options):
                got = self.fs.cat_ranges([self.uri.path] * len(batch), batch, ends)
            for s, data in zip(batch, got, strict=True):
                if isinstance(data, BaseException):
                    raise storage_error(data, str(self.uri), secrets(self.storage_options))
                yield s, bytes(data)

    def read_into(self, view: memoryview, offset: int, label: str) -> None:
        """Fill `view` from `offset`; CheckpointError when the object ends first."""
        if len(view) <= SMALL_READ:
            data = self.read(len(view), offset)
            view[: len(data)] = data
            got = len(data)
        else:
            got = 0
            for start, data in self.ranges(offset, len(view)):
                view[start - offset : start - offset + len(data)] = data
                got += len(data)
        if got < len(view):
            raise CheckpointError(
                f"{label}: short read at byte {offset + got} ({len(view) - got} bytes missing); "
                "the object is truncated or changed during the merge"
            )

    def copy_to(
        self,
        dst_fd: int,
        src_off: int,
        dst_off: int,
        count: int,
        write: Callable[[int, memoryview, int], None] | None = None,
    ) -> None:
        """[src_off, src_off + count) written at `dst_off` of the local file `dst_fd` (by
        `write(fd, data, offset)` when given: `io.copy.pwrite_all`, which feeds a hash)."""
        done = 0
        for start, data in self.ranges(src_off, count):
            view = memoryview(data)
            at = dst_off + start - src_off
            if write is not None:
                write(dst_fd, view, at)
            while view and write is None:
                n = os.pwrite(dst_fd, view, at)
                view, at = view[n:], at + n
            done += len(data)
        if done < count:
            raise CheckpointError(
                f"{self.uri}: unexpected end of the object at byte {src_off + done} while copying"
            )


# ---------------------------------------------------------------- stand-ins in the local tree

# (st_dev, st_ino) of a local stand-in -> the object it stands for
_STAND_INS: dict[tuple[int, int], RemoteObject] = {}
_STAND_INS_LOCK = threading.Lock()


def register_stand_in(st: os.stat_result, obj: RemoteObject) -> None:
    with _STAND_INS_LOCK:
        _STAND_INS[(st.st_dev, st.st_ino)] = obj


def forget_stand_ins(objects: list[tuple[int, int]]) -> None:
    with _STAND_INS_LOCK:
        for key in objects:
            _STAND_INS.pop(key, None)


def remote_of(fd: int) -> RemoteObject | None:
    """The object the open local file `fd` stands for (None: a local file)."""
    if not _STAND_INS:  # no remote checkpoint in this process: no fstat either
        return None
    st = os.fstat(fd)
    return _STAND_INS.get((st.st_dev, st.st_ino))


def remote_of_path(path: os.PathLike[str] | str) -> RemoteObject | None:
    """The object the local file `path` stands for (None: a local file, or none)."""
    if not _STAND_INS:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _STAND_INS.get((st.st_dev, st.st_ino))


def pread(fd: int, n: int, offset: int) -> bytes:
    """`os.pread`, served by the store for a stand-in."""
    remote = remote_of(fd)
    return os.pread(fd, n, offset) if remote is None else remote.read(n, offset)


def preadinto(fd: int, view: memoryview, offset: int) -> int:
    """`os.preadv(fd, [view], offset)`, served by the store for a stand-in."""
    remote = remote_of(fd)
    if remote is None:
        return os.preadv(fd, [view], offset)
    data = remote.read(len(view), offset)
    view[: len(data)] = data
    return len(data)
