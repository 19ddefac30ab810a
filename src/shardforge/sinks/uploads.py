"""The requests an object-store output makes: multipart uploads, their parts, the journal that
lets an interrupted merge resume, and the prefix's objects.

Every request goes through `Store`, which turns a failure into one `StorageError` line naming
the URI (never a secret). Parts are cut from each planned file at multiples of a part size
chosen from the throughput measured so far (`PartSizer`); the journal
(``<parent>/.<name>.shardforge-merge.json``, beside the output prefix, never inside it) records
each file's upload id and part size, so `--resume` finds the parts a killed merge uploaded.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardforge.errors import StorageError
from shardforge.io.mirror import RemoteTarget
from shardforge.io.remote import RemoteURI, storage_errors

# S3's limits: every part but the last at least 5 MiB, at most 10,000 parts
MIN_PART = 5 << 20
MAX_PARTS = 10_000
# part sizes: at first, then chosen so that one part takes about `PART_SECONDS` to upload
FIRST_PART = 16 << 20
MAX_PART = 128 << 20
PART_SECONDS = 2.0
# a part's body is sent in pieces of this size
PIECE = 256 << 10


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


def owner_alive(who: Mapping[str, Any]) -> bool:
    """Whether the merge that wrote a journal runs still (on this host; another host's counts
    as gone: a merge is resumed, or its leftovers removed, from any machine)."""
    import psutil

    if who.get("host") != socket.gethostname():
        return False
    try:
        return bool(psutil.Process(int(who["pid"])).create_time() == who["start"])
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


@dataclass
class Store:
    """The requests of one output prefix (see the module docstring)."""

    target: RemoteTarget

    @property
    def uri(self) -> RemoteURI:
        return self.target.uri

    def call(self, method: str, where: object = None, **kwargs: Any) -> Any:
        with storage_errors(where or self.uri, self.target.storage_options):
            return self.target.fs.call_s3(method, **kwargs)

    def key(self, name: str) -> str:
        return self.uri.child(name).key

    def on_object(self, method: str, name: str, **kwargs: Any) -> Any:
        """`method` on the object `name` under the prefix (errors name its URI)."""
        where = self.uri.child(name)
        return self.call(method, where, Bucket=self.uri.bucket, Key=where.key, **kwargs)

    def journal_key(self) -> str:
        parent, _, name = self.uri.key.rpartition("/")
        return (
            f"{parent}/.{name}.shardforge-merge.json"
            if parent
            else f".{name}.shardforge-merge.json"
        )

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
            if ": not found" in exc.message:
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

    def parts(self, name: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """The parts uploaded so far: number -> (size, ETag); none when the upload is gone."""
        found: dict[int, tuple[int, str]] = {}
        marker: dict[str, Any] = {}
        while True:
            try:
                page = self.on_object("list_parts", name, UploadId=upload_id, **marker)
            except StorageError:  # the upload was aborted or completed meanwhile
                return {}
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
    sha256: str | None = None  # the file's, as its staging file was filled (`sinks.manifest`)


@dataclass
class Journal:
    """What an interrupted merge left to resume: its owner, plan and uploads (module doc)."""

    store: Store
    fingerprint: Mapping[str, Any]  # `sinks.resume.fingerprint`
    files: dict[str, FileUpload] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

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
                        "sha256": f.sha256,
                    }
                    for n, f in self.files.items()
                },
            }
        body = json.dumps(data, indent=1).encode()
        self.store.call(
            "put_object",
            Bucket=self.store.uri.bucket,
            Key=self.store.journal_key(),
            Body=body,
        )

    def delete(self) -> None:
        self.store.delete(self.store.journal_key())

    @staticmethod
    def load(store: Store) -> dict[str, Any] | None:
        """The journal left beside the prefix (None: none)."""
        try:
            with storage_errors(store.uri, store.target.storage_options):
                body = store.target.fs.cat_file(f"{store.uri.bucket}/{store.journal_key()}")
        except StorageError as exc:
            if "not found" in exc.message:
                return None
            raise
        try:
            data = json.loads(body)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def abort_all(self) -> None:
        """Abort every upload not completed; remove the journal (best effort, stopped at the
        first failed request: called while a failure is already on its way)."""
        with contextlib.suppress(Exception):  # the store is down: a later merge cleans up
            for name, f in self.files.items():
                if f.completed is None:
                    self.store.abort(name, f.upload_id)
            self.delete()


def abort_left(store: Store, data: Mapping[str, Any]) -> None:
    """Abort the uploads a journal lists and remove it (a stale merge's leftovers)."""
    for name, entry in dict(data.get("files") or {}).items():
        if isinstance(entry, dict) and entry.get("completed") is None:
            with contextlib.suppress(Exception):  # a failure is on its way already
                store.abort(str(name), str(entry.get("upload_id")))
    store.delete(store.journal_key())
