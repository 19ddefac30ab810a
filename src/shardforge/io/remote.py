"""Object storage (S3 and S3-compatible stores) as bytes: URIs, a file system per endpoint and
credentials, errors in one line without secrets, and remote objects read by byte ranges.

    uri = RemoteURI.parse("s3://bucket/run/checkpoint-100")
    fs = filesystem(storage_options)          # s3fs; credentials from storage_options, else AWS_*
    obj = RemoteObject(fs, uri.child("__0_0.distcp"), size)
    obj.read_into(buffer, offset, label)      # ranged GETs, several at a time for large reads
    obj.copy_to(fd, src_off, dst_off, count)  # ... streamed into a local file

A remote object stands in the local file tree as a sparse file of its size (`io.mirror`); the
file's identity is registered here (`register_stand_in`), and every read the byte path makes
through a descriptor of it (`pread`, `preadinto`, `io.files.read_exact_into`,
`io.copy.copy_range`) is served by ranged requests instead. Formats read through those
functions only, so they read a remote checkpoint unchanged, record bounds and CRCs checked as
for a local one. A large read is cut into ranged GETs of `PART_BYTES`, `PARALLEL` in flight
on the file system's event loop, and each body is written where it belongs (`pwrite` into the
local file, or into the caller's buffer) piece by piece as it arrives: no part is held whole.
Memory: `PARALLEL` pieces of `STREAM_CHUNK` at most, and `CACHE_BLOCKS` blocks of
`SMALL_BLOCK` for the small reads of record headers.

Nothing here imports s3fs until a remote path is used (the `s3` extra installs it).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardforge.errors import CheckpointError, ShardforgeError, StorageError
from shardforge.io.s3_adapter import acall, error_code, kind, run

SCHEME = "s3://"
# a large read is split into ranged GETs of this size, `PARALLEL` at a time, each streamed
# into its destination (a local file or the caller's buffer) as its body arrives
PART_BYTES = 16 << 20
PARALLEL = 8
# a read of at most `SMALL_READ` bytes fetches the aligned `SMALL_BLOCK` around it, cached
SMALL_READ = 64 << 10
SMALL_BLOCK = 128 << 10
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
# and connections enough for the reads and the uploads in flight at once
DEFAULT_CONFIG = {
    "retries": {"max_attempts": 3, "mode": "standard"},
    "connect_timeout": 5,
    "max_pool_connections": 32,
}


def filesystem(storage_options: Mapping[str, Any] | None = None) -> Any:
    """An s3fs file system with `storage_options` (s3fs's keywords: key, secret, token,
    endpoint_url, client_kwargs, ...); credentials and endpoint not given there come from the
    usual AWS variables and files (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws)."""
    try:
        import s3fs
    except ImportError:
        raise StorageError("s3:// paths need s3fs: pip install 'shardforge[s3]'") from None
    return s3fs.S3FileSystem(**fsspec_options(storage_options))


def fsspec_options(storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`storage_options` as s3fs takes them (`filesystem`, and torch DCP's fsspec writer):
    botocore's `config_kwargs` completed with `DEFAULT_CONFIG`. A deep copy: botocore rewrites
    the `retries` it is given in place (`max_attempts` -> `total_max_attempts`), and the next
    call's options, changed, would miss fsspec's instance cache: a second S3 client, with its own
    copy of botocore's S3 model (about 16 MB)."""
    for name in ("botocore", "aiobotocore", "s3fs"):  # their notices name endpoints and ids
        logging.getLogger(name).setLevel(logging.WARNING)
    options = copy.deepcopy(dict(storage_options or {}))
    config = {**copy.deepcopy(DEFAULT_CONFIG), **dict(options.pop("config_kwargs", None) or {})}
    return {**options, "config_kwargs": config}


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
    """One line for a failed request at `where`: what went wrong and what to do. Its `kind`
    (`s3_adapter.kind`: from the error's type and S3 code) is what callers decide by."""
    reason = redact(_reason(exc), hidden or [])
    name = type(exc).__name__
    found = kind(exc)
    if found == "failed" and ("AccessDenied" in reason or "signature" in reason):
        found = "denied"
    elif found == "failed" and "connect" in (reason + name).lower():
        found = "unreachable"
    if found == "denied":
        hint = "access denied ({}); check the credentials (storage_options key/secret or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
    elif found == "missing" and (error_code(exc) == "NoSuchBucket" or "bucket" in reason.lower()):
        hint = "no such bucket ({}); create it or fix the URI"
    elif found == "missing":
        hint = "not found ({})"
    elif found == "unreachable":
        hint = "the object store cannot be reached ({}); check the endpoint and that it is up"
    else:
        hint = (
            f"the request failed ({name}: {{}}); the store may be down or throttling - retry later"
        )
    error = StorageError(f"{where}: {hint.format(reason)}")
    error.kind = found
    return error


@contextlib.contextmanager
def storage_errors(
    where: object, storage_options: Mapping[str, Any] | None = None
) -> Iterator[None]:
    """Turn a failed request inside the block into one `StorageError` line naming `where`."""
    try:
        yield
    except ShardforgeError:  # already one line (a store error, a bad checkpoint, a check)
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
    """One object of the store, `size` bytes, read by byte ranges. `etag` (and `version_id`):
    the version the listing found, pinned (`io.pins`): every ranged GET carries it as
    ``If-Match`` (``VersionId``), and an object replaced since is an error naming it, never
    bytes of another version."""

    fs: Any
    uri: RemoteURI
    size: int
    storage_options: Mapping[str, Any] | None = None
    etag: str | None = None
    version_id: str | None = None

    def _get(self, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        got = self._stream(start, end - start, _ViewSink(memoryview(buf), start))
        return bytes(buf[:got])

    def _block(self, index: int) -> bytes:
        """Block `index` of `SMALL_BLOCK` bytes, from the cache of recent small reads."""
        start = index * SMALL_BLOCK
        return _CACHE.get(
            (f"{self.uri}@{self.etag}", index),
            lambda: self._get(start, min(self.size, start + SMALL_BLOCK)),
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
        buf = bytearray(end - offset)
        self.read_into(memoryview(buf), offset, str(self.uri))
        return bytes(buf)

    def read_into(self, view: memoryview, offset: int, label: str) -> None:
        """Fill `view` from `offset`; CheckpointError when the object ends first."""
        if len(view) <= SMALL_READ:
            data = self.read(len(view), offset)
            view[: len(data)] = data
            got = len(data)
        else:
            got = self._stream(offset, len(view), _ViewSink(view.cast("B"), offset))
        if got < len(view) and offset + got < self.size:  # shorter than its listing
            raise changed_error(label, f"it ends at byte {offset + got}, not {self.size}")
        if got < len(view):
            raise CheckpointError(
                f"{label}: short read at byte {offset + got} ({len(view) - got} bytes missing); "
                "the object is truncated"
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
        `write(fd, data, offset)` when given: `io.copy.pwrite_then_hash`, which feeds a hash)."""
        done = self._stream(src_off, count, _FileSink(dst_fd, dst_off - src_off, write))
        if done < count and src_off + done < self.size:  # shorter than its listing
            raise changed_error(self.uri, f"it ends at byte {src_off + done}, not {self.size}")
        if done < count:
            raise CheckpointError(
                f"{self.uri}: unexpected end of the object at byte {src_off + done} while copying"
            )

    def _stream(self, offset: int, n: int, sink: _Sink) -> int:
        """Fetch [offset, offset + n) in parts of `PART_BYTES`, `PARALLEL` GETs at a time on
        the file system's event loop, each body handed to `sink` as it arrives (no part is
        held whole); the bytes received (fewer only where the object ends first)."""
        end = min(self.size, offset + n)
        if end <= offset:
            return 0
        with storage_errors(self.uri, self.storage_options):
            return int(run(self.fs, self._parts, offset, end, sink))

    async def _parts(self, offset: int, end: int, sink: _Sink) -> int:
        import asyncio

        gate = asyncio.Semaphore(PARALLEL)
        failed: list[BaseException] = []

        async def part(start: int) -> int:
            async with gate:
                if failed:  # a part failed: start no more
                    return 0
                try:
                    return await self._part(start, min(end, start + PART_BYTES), sink)
                except BaseException as exc:
                    failed.append(exc)
                    raise

        # every part started has ended before this returns (none writes into the sink later)
        got = await asyncio.gather(
            *(part(s) for s in range(offset, end, PART_BYTES)), return_exceptions=True
        )
        if failed:
            raise failed[0]
        # the bytes up to the first short part (the object ended there)
        total = 0
        for start, n in zip(range(offset, end, PART_BYTES), got, strict=True):
            assert isinstance(n, int)
            total += n
            if n < min(end, start + PART_BYTES) - start:
                break
        return total

    def _pinned(self) -> dict[str, str]:
        """The request's conditions: the pinned version (`etag`, `version_id`)."""
        found = {"IfMatch": self.etag} if self.etag else {}
        return {**found, "VersionId": self.version_id} if self.version_id else found

    async def _part(self, start: int, end: int, sink: _Sink) -> int:
        """One ranged GET of the pinned version, its body written to `sink` chunk by chunk as
        it arrives."""
        try:
            resp = await acall(
                self.fs,
                "get_object",
                Bucket=self.uri.bucket,
                Key=self.uri.key,
                Range=f"bytes={start}-{end - 1}",
                **self._pinned(),
            )
        except OSError as exc:
            if kind(exc) == "changed":  # another version now, or a shorter one
                how = f"a GET of the version with ETag {self.etag} answers {error_code(exc)}"
                raise changed_error(self.uri, how) from None
            raise
        body = resp["Body"]
        at = start
        try:
            while at < end:
                chunk = await body.read(min(STREAM_CHUNK, end - at))
                if not chunk:
                    break
                sink.write(at, chunk)
                at += len(chunk)
        finally:
            body.close()
        return at - start

    async def _change(self) -> str | None:
        """How the object differs from the pinned version now (None: it does not)."""
        try:
            head = await acall(self.fs, "head_object", Bucket=self.uri.bucket, Key=self.uri.key)
        except OSError as exc:
            if kind(exc) == "missing":
                return "it was removed"
            raise
        etag, size = head.get("ETag"), int(head.get("ContentLength", -1))
        if self.etag and etag != self.etag:
            return f"ETag {self.etag} -> {etag}"
        return None if size == self.size else f"size {self.size} -> {size}"


def changed_error(name: object, how: str) -> CheckpointError:
    """The one line for an input that changed under the merge (`io.pins`)."""
    return CheckpointError(
        f"{name}: changed while the merge read it; nothing was published - merge again once "
        "the checkpoint is complete and no longer written",
        [how],
    )


def changed_objects(objects: list[RemoteObject]) -> list[tuple[RemoteObject, str]]:
    """The objects that differ from their pinned version now, and how (one HEAD each, all at
    once on each file system's event loop)."""

    async def each(group: list[RemoteObject]) -> list[str | None]:
        import asyncio

        return list(await asyncio.gather(*(o._change() for o in group)))

    found: list[tuple[RemoteObject, str]] = []
    groups: dict[int, list[RemoteObject]] = {}
    for obj in objects:
        groups.setdefault(id(obj.fs), []).append(obj)
    for group in groups.values():
        first = group[0]
        with storage_errors(first.uri, first.storage_options):
            answers = run(first.fs, each, group)
        found += [(o, how) for o, how in zip(group, answers, strict=True) if how is not None]
    return found


# a ranged GET's body is taken from the connection in pieces of at most this size
STREAM_CHUNK = 1 << 20


class _Sink:
    def write(self, at: int, data: bytes) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class _FileSink(_Sink):
    """Object byte `at` goes to byte `at + shift` of the local file `fd`."""

    fd: int
    shift: int
    writer: Callable[[int, memoryview, int], None] | None = None

    def write(self, at: int, data: bytes) -> None:
        view, pos = memoryview(data), at + self.shift
        if self.writer is not None:
            self.writer(self.fd, view, pos)
            return
        while view:
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n


@dataclass(frozen=True)
class _ViewSink(_Sink):
    """Object bytes from `start` on fill `view`."""

    view: memoryview
    start: int

    def write(self, at: int, data: bytes) -> None:
        self.view[at - self.start : at - self.start + len(data)] = data


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
