"""The requests an object-store output makes: multipart uploads, their parts, the journal that
lets an interrupted merge resume, and the prefix's objects.

Every request goes through `Store`, which turns a failure into one `StorageError` line naming
the URI (never a secret). Parts are cut from each planned file at multiples of a part size
chosen from the throughput measured so far (`PartSizer`); the journal
(``<parent>/.<name>.shardforge-merge-<id>.json``, beside the output prefix, never inside it; one
key per merge, so that no merge overwrites or removes another's) records each file's upload id
and part size, so `--resume` finds the parts a killed merge uploaded.

Cleanup after a failure or a signal (`Cleanup`) tries each request again (`CLEANUP_TRIES`, within
`CLEANUP_S`) and goes on after one that fails: a stale connection or a short outage leaves
neither a journal nor an open upload behind. A request that makes an object (completing an
upload, a PUT) is waited for when a signal interrupts it (`IN_FLIGHT_S`), so that the cleanup
never deletes an object a moment before the store makes it.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardforge.errors import MergeError, StorageError
from shardforge.io.mirror import RemoteTarget
from shardforge.io.remote import RemoteURI, storage_errors
from shardforge.io.s3_adapter import call, call_waiting

# S3's limits: every part but the last at least 5 MiB, at most 10,000 parts
MIN_PART = 5 << 20
MAX_PARTS = 10_000
# part sizes: at first, then chosen so that one part takes about `PART_SECONDS` to upload
FIRST_PART = 16 << 20
MAX_PART = 128 << 20
PART_SECONDS = 2.0
# a part's body is sent in pieces of this size
PIECE = 256 << 10
# cleanup: tries of each request, and the time after which a failed one is not tried again
CLEANUP_TRIES = 4
CLEANUP_S = 30.0
# how long an interrupted request that makes an object is waited for (`Store.call`)
IN_FLIGHT_S = 60.0
# the requests that make an object under the prefix
_MAKERS = frozenset({"complete_multipart_upload", "put_object"})
JOURNAL_SUFFIX = ".shardforge-merge"
# what follows `.<name>.shardforge-merge` in a journal's key (the id; none: an older shardforge)
_JOURNAL_TAIL = re.compile(r"^(?:-[0-9a-f]{1,64})?\.json$")

log = logging.getLogger("shardforge")


class PartSizer:
    """The part size of the next file, from the upload throughput measured so far."""

    def __init__(self) -> None:
        self._bytes = 0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def measured(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self._seconds += seconds

    def size_for(self, file_size: int) -> int:
        with self._lock:
            rate = self._bytes / self._seconds if self._seconds > 0 else None
        size = FIRST_PART if rate is None else int(rate * PART_SECONDS)
        size = max(MIN_PART, min(MAX_PART, size), math.ceil(file_size / MAX_PARTS))
        return -(-size // (1 << 20)) << 20  # whole MiB


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """(start, stop) of each part of a `size`-byte file (at least one)."""
    return [(s, min(size, s + part_size)) for s in range(0, max(size, 1), part_size)]


def owner() -> dict[str, Any]:
    import psutil

    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start": psutil.Process(pid).create_time()}


def owner_alive(who: Mapping[str, Any], key: str) -> bool:
    """Whether the merge that wrote the journal `key` runs still (on this host; another host's
    counts as gone: a merge is resumed, or its leftovers removed, from any machine). This
    process's own journal counts while one of its merges writes it (`Journal.release`)."""
    import psutil

    if who.get("host") != socket.gethostname():
        return False
    try:
        alive = bool(psutil.Process(int(who["pid"])).create_time() == who["start"])
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False
    if alive and int(who["pid"]) == os.getpid():
        with _WRITING_LOCK:
            return key in _WRITING
    return alive


# the journal keys this process's merges write now
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


@dataclass
class Store:
    """The requests of one output prefix (see the module docstring)."""

    target: RemoteTarget

    @property
    def uri(self) -> RemoteURI:
        return self.target.uri

    def call(self, method: str, where: object = None, **kwargs: Any) -> Any:
        with storage_errors(where or self.uri, self.target.storage_options):
            if method in _MAKERS:  # a signal waits for its answer (module docstring)
                return call_waiting(self.target.fs, method, IN_FLIGHT_S, **kwargs)
            return call(self.target.fs, method, **kwargs)

    def key(self, name: str) -> str:
        return self.uri.child(name).key

    def on_object(self, method: str, name: str, **kwargs: Any) -> Any:
        """`method` on the object `name` under the prefix (errors name its URI)."""
        where = self.uri.child(name)
        return self.call(method, where, Bucket=self.uri.bucket, Key=where.key, **kwargs)

    def journal_prefix(self) -> str:
        """What the key of every journal of a merge to this prefix starts with."""
        parent, _, name = self.uri.key.rpartition("/")
        return f"{parent}/.{name}{JOURNAL_SUFFIX}" if parent else f".{name}{JOURNAL_SUFFIX}"

    def new_journal_key(self) -> str:
        """The journal key of a new merge: beside the prefix, its own (`uuid4`)."""
        return f"{self.journal_prefix()}-{uuid.uuid4().hex[:16]}.json"

    def journals(self) -> list[dict[str, Any]]:
        """The journals beside the prefix (``Key``, ``LastModified``), oldest first."""
        start = self.journal_prefix()
        found: list[dict[str, Any]] = []
        token: dict[str, Any] = {}
        while True:
            page = self.call("list_objects_v2", Bucket=self.uri.bucket, Prefix=start, **token)
            found += [
                o for o in page.get("Contents", []) if _JOURNAL_TAIL.match(o["Key"][len(start) :])
            ]
            if not page.get("IsTruncated"):
                return sorted(found, key=lambda o: (o["LastModified"], o["Key"]))
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def objects(self) -> Iterator[dict[str, Any]]:
        """Every object under the prefix (``Key``, ``Size``, ``ETag``)."""
        token: dict[str, Any] = {}
        while True:
            page = self.call(
                "list_objects_v2", Bucket=self.uri.bucket, Prefix=self.uri.key + "/", **token
            )
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def head_bucket(self) -> None:
        where = f"s3://{self.uri.bucket}"
        try:
            self.call("head_bucket", where=where, Bucket=self.uri.bucket)
        except StorageError as exc:
            if exc.kind == "missing":
                raise StorageError(f"{where}: no such bucket; create it or fix the URI") from None
            raise

    def put(self, name: str, body: bytes) -> None:
        self.on_object("put_object", name, Body=body)

    def delete(self, key: str) -> None:
        self.call("delete_object", Bucket=self.uri.bucket, Key=key)

    def create(self, name: str) -> str:
        out = self.on_object("create_multipart_upload", name)
        return str(out["UploadId"])

    def upload(self, name: str, upload_id: str, number: int, body: FileRange) -> str:
        """Upload part `number` of `name`, its bytes read from `body` as they are sent."""
        out = self.on_object(
            "upload_part",
            name,
            UploadId=upload_id,
            PartNumber=number,
            ContentLength=len(body),
            Body=body,
        )
        return str(out["ETag"])

    def parts(self, name: str, upload_id: str) -> dict[int, tuple[int, str]] | None:
        """The parts uploaded so far: number -> (size, ETag); None when the upload is gone
        (aborted, or completed)."""
        found: dict[int, tuple[int, str]] = {}
        marker: dict[str, Any] = {}
        while True:
            try:
                page = self.on_object("list_parts", name, UploadId=upload_id, **marker)
            except StorageError:  # the upload was aborted or completed meanwhile
                return None
            for p in page.get("Parts", []):
                found[int(p["PartNumber"])] = (int(p["Size"]), str(p["ETag"]))
            if not page.get("IsTruncated"):
                return found
            marker = {"PartNumberMarker": page["NextPartNumberMarker"]}

    def complete(self, name: str, upload_id: str, etags: Mapping[int, str]) -> str:
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(etags.items())]
        out = self.on_object(
            "complete_multipart_upload", name, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
        return str(out.get("ETag", ""))

    def abort(self, name: str, upload_id: str) -> None:
        self.on_object("abort_multipart_upload", name, UploadId=upload_id)


class Cleanup:
    """The requests of a cleanup after a failure: each tried `CLEANUP_TRIES` times (while
    `CLEANUP_S` have not passed), a failed one recorded and the next made; a missing object or
    upload counts as done. Once a request found the store unreachable through all its tries,
    the rest are recorded as not tried (a store that is down is not asked again and again)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.deadline = time.monotonic() + (CLEANUP_S if seconds is None else seconds)
        self.failed: list[str] = []
        self.unreachable = ""  # the store could not be reached through a request's every try

    def __call__(self, what: str, request: Callable[[], object]) -> None:
        if self.unreachable:  # a store that is down: the next requests are not tried
            self.failed.append(f"{what}: not tried ({self.unreachable})")
            return
        last, unreachable = "", False
        for attempt in range(CLEANUP_TRIES):
            try:
                request()
                return
            except StorageError as exc:
                if exc.kind == "missing":  # an upload aborted or completed, an object deleted
                    return
                last, unreachable = exc.message, exc.kind == "unreachable"
            except Exception as exc:  # not a store error: nothing to retry
                self.failed.append(f"{what}: {type(exc).__name__}")
                return
            if attempt + 1 == CLEANUP_TRIES or time.monotonic() >= self.deadline:
                break
            log.info("cleanup: %s failed (%s); trying again", what, last)
            time.sleep(min(0.5 * 2**attempt, 4.0, max(0.0, self.deadline - time.monotonic())))
        self.failed.append(f"{what}: {last}")
        if unreachable:
            self.unreachable = "the object store cannot be reached"

    def report(self, where: object, who: str = "a later merge") -> None:
        """One notice listing what the cleanup could not do (`who` removes it)."""
        if self.failed:
            log.warning(
                "%s: the cleanup left %d request(s) undone (%s to it removes what is left): %s",
                where,
                len(self.failed),
                who,
                "; ".join(self.failed[:5]),
            )


class FileRange:
    """Bytes [start, stop) of the open local file `fd` as a seekable, read-only stream: a
    part's body, read by the client in pieces (its checksum, its signature, the request)
    straight from the staging file, never held whole in memory. Not an `io.IOBase`: aiohttp
    sends it as an async iterable, read on the event loop's thread, instead of reading it on
    executor threads (each of which would keep a malloc arena of freed pieces)."""

    def __init__(self, fd: int, start: int, stop: int) -> None:
        self.fd, self.start, self.stop = fd, start, stop
        self.pos = 0

    def __len__(self) -> int:
        return self.stop - self.start

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self)}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, len(self) - self.pos)
        data = os.pread(self.fd, left if n < 0 else min(n, left), self.start + self.pos)
        self.pos += len(data)
        return data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[bytes]:
        while piece := self.read(PIECE):
            yield piece


@dataclass
class FileUpload:
    """One planned file's multipart upload: its id, part size and the parts done."""

    upload_id: str
    part_size: int
    etags: dict[int, str] = field(default_factory=dict)
    completed: str | None = None  # the object's ETag once completed
    completing: bool = False  # its completion was asked for (recorded before the request)
    # the file's digest, by hash name, as its staging file was filled (`sinks.manifest`)
    digests: dict[str, str] = field(default_factory=dict)


@dataclass
class Journal:
    """What an interrupted merge left to resume: its owner, plan and uploads (module doc),
    under `key`: this merge's own (`Store.new_journal_key`), or the one it resumes."""

    store: Store
    fingerprint: Mapping[str, Any]  # `sinks.resume.fingerprint`
    key: str = ""
    files: dict[str, FileUpload] = field(default_factory=dict)
    # the small files (config, index, manifest) it puts, recorded before the first request
    puts: list[str] = field(default_factory=list)
    resumed: bool = False  # the journal of an interrupted merge, taken over
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.key = self.key or self.store.new_journal_key()
        with _WRITING_LOCK:
            _WRITING.add(self.key)

    def release(self) -> None:
        """This merge has ended: a later one of this process may take the journal over."""
        with _WRITING_LOCK:
            _WRITING.discard(self.key)

    def save(self) -> None:
        with self._lock:
            data = {
                "owner": owner(),
                "fingerprint": self.fingerprint,
                "files": {
                    n: {
                        "upload_id": f.upload_id,
                        "part_size": f.part_size,
                        "completed": f.completed,
                        "completing": f.completing,
                        "digests": f.digests,
                    }
                    for n, f in self.files.items()
                },
                "put": list(self.puts),
            }
        body = json.dumps(data, indent=1).encode()
        self.store.call("put_object", Bucket=self.store.uri.bucket, Key=self.key, Body=body)

    def delete(self) -> None:
        self.store.delete(self.key)

    @staticmethod
    def found(store: Store) -> list[tuple[str, dict[str, Any]]]:
        """The journals left beside the prefix, oldest first: (key, contents); one that is not
        a JSON object reads as empty (its uploads unknown)."""
        left = []
        for obj in store.journals():
            try:
                with storage_errors(store.uri, store.target.storage_options):
                    body = store.target.fs.cat_file(f"{store.uri.bucket}/{obj['Key']}")
            except StorageError as exc:
                if exc.kind == "missing":  # removed meanwhile (its merge finished)
                    continue
                raise
            try:
                data = json.loads(body)
            except ValueError:
                data = {}
            left.append((str(obj["Key"]), data if isinstance(data, dict) else {}))
        return left

    def abort_all(self, cleanup: Cleanup | None = None) -> Cleanup:
        """Abort every upload not completed, then remove the journal: each request tried again
        and the next made after a failure (`Cleanup`; called while a failure is on its way,
        so nothing is raised: what failed is in the result's `failed`)."""
        cleanup = cleanup or Cleanup()
        for name, f in list(self.files.items()):
            if f.completed is None:
                cleanup(f"abort {name}", functools.partial(self.store.abort, name, f.upload_id))
        cleanup("delete the journal", self.delete)
        return cleanup


def abort_left(store: Store, key: str, data: Mapping[str, Any]) -> Cleanup:
    """Abort the uploads the journal `key` lists and remove it (a stale merge's leftovers; its
    completed files stay: they may be a published model)."""
    cleanup = Cleanup()
    for name, entry in dict(data.get("files") or {}).items():
        if isinstance(entry, dict) and entry.get("completed") is None:
            abort = functools.partial(store.abort, str(name), str(entry.get("upload_id")))
            cleanup(f"abort {name}", abort)
    cleanup("delete the journal", functools.partial(store.delete, key))
    return cleanup


class PrefixTaken(MergeError):
    """Objects under the prefix that neither this merge nor the one it resumes made: nothing is
    published; a resumed merge keeps the journal it took over (and its uploads)."""

    def __init__(self, uri: object, found: list[str], resumed: bool) -> None:
        if resumed:
            what = "remove them and run it again with --resume, or pass --overwrite"
            kept = "; the interrupted merge's journal is kept"
        else:
            what = "choose another --output_path, or pass --overwrite"
            kept = ""
        super().__init__(
            f"{uri}: objects appeared under the prefix while the merge ran (listed below); "
            f"nothing was published{kept} - {what}",
            found,
        )
