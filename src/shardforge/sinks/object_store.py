"""The object-store output: the Hugging Face directory of `sinks.hf_dir`, published under an
s3:// prefix by multipart uploads (`sinks.uploads` makes the requests).

Write: each planned file is filled in a sparse staging file, tensor by tensor in file order,
by the same `TensorSource.write` as a local merge. As soon as every byte of a part is written,
the part is read, uploaded on one of `UPLOADS` threads and its blocks given back to the file
system: staging holds the parts in flight and the tensor being written. The part size follows
the throughput measured so far (`uploads.PartSizer`).

Publish rule: nothing under the prefix changes before every part of every file is uploaded.
Then (with --overwrite, the previous index removed first) the weight files are completed, the
config and tokenizer put, objects of a previous model that the new one lacks removed, and the
index - the single weights file when unsharded - written last: a reader of the prefix never
finds an index before every shard is complete. --overwrite replaces a model only: a prefix
holding anything a merge does not write is refused (`io.model_files`) unless
--overwrite_non_model, before anything is read and again before publishing.

Cleanup: any failure, SIGTERM or Ctrl-C before the index is published removes every object
this merge may have made (each is recorded before the request that makes it, and such a request
is waited for when a signal interrupts it: `uploads.Store.call`), aborts the uploads and then
removes this merge's journal (its own key: never another merge's), each request tried again
(`uploads.Cleanup`). Once the index is published nothing is removed (`_finish`).

Resume (--resume): the journal of the interrupted merge must name the same plan and inputs;
its completed files are kept when their size and ETag still match, its uploaded parts when
their size matches, and only the rest is read and uploaded; the small objects it put (listed
in the journal before the first PUT) count as its own. Refused at publishing, a resumed merge
keeps the journal it took over.

The integrity manifest (`sinks.manifest`) is put last: each file's SHA-256 is computed as its
staging file is filled (every tensor is then written, also those of parts an interrupted merge
uploaded, which are not uploaded again) and kept in the journal for a resumed merge; the journal
is removed once the manifest is put.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardforge.errors import MergeError, StorageError
from shardforge.formats.base import Destination
from shardforge.formats.sources import TensorSource
from shardforge.io.copy import ReadCache, pwrite_all
from shardforge.io.digest import ALGORITHMS, hash_of, hashing
from shardforge.io.fs import punch_hole
from shardforge.io.mirror import RemoteTarget
from shardforge.io.model_files import refuse_non_model
from shardforge.io.pins import check_and_release as check_pins
from shardforge.io.remote import storage_errors
from shardforge.sinks.base import Output, Progress, Sink, WriteOptions, human, verified_line
from shardforge.sinks.hf_dir import HfDirectorySink, resume_fingerprint, write_companions
from shardforge.sinks.manifest import MANIFEST as MANIFEST_NAME
from shardforge.sinks.manifest import new_hashes, write_manifest
from shardforge.sinks.plan import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, PlannedFile
from shardforge.sinks.progress import progress
from shardforge.sinks.resume import resume_refused
from shardforge.sinks.safetensors_files import Hashes, write_index
from shardforge.sinks.uploads import (
    Cleanup,
    FileRange,
    FileUpload,
    Journal,
    PartSizer,
    PrefixTaken,
    Store,
    abort_left,
    owner_alive,
    part_ranges,
)
from shardforge.sinks.verify import verify_output

log = logging.getLogger("shardforge")

# parts uploaded at once (each read from the staging file as it is sent, not held in memory)
UPLOADS = 8


def check_target(
    target: RemoteTarget, overwrite: bool, resume: bool, non_model: bool = False
) -> None:
    """Before anything is read: the bucket answers, no live merge writes there, and the prefix
    is empty unless --overwrite (or --resume of an interrupted merge's journal); with
    --overwrite it holds a model and nothing else unless `non_model` (`io.model_files`)."""
    store = Store(target)
    if not target.uri.key:
        raise MergeError(f"{target.uri}: name a prefix inside the bucket (s3://BUCKET/PREFIX)")
    store.head_bucket()
    left = Journal.found(store)
    for key, data in left:
        who = data.get("owner")
        if isinstance(who, dict) and owner_alive(who, key):
            raise MergeError(
                f"{target.uri}: another merge (pid {who.get('pid')}) is writing there; "
                "wait for it or choose another --output_path"
            )
    if left and not resume:
        for key, data in left:
            abort_left(store, key, data).report(target.uri)
        log.info("removed the uploads of an interrupted merge to %s", target.uri)
        left = []
    if left or (overwrite and non_model):
        return
    if not overwrite:
        if next(iter(store.objects()), None) is not None:
            raise MergeError(
                f"{target.uri}: output prefix holds objects; pass --overwrite to replace them"
            )
        return
    refuse_non_model(target.uri, [o["Key"][len(target.uri.key) + 1 :] for o in store.objects()])


class ObjectStoreSink(Sink):
    """A Hugging Face model directory under an s3:// prefix (see the module docstring)."""

    name = "hf"

    def __init__(self, target: RemoteTarget) -> None:
        self.target = target
        self.store = Store(target)
        self.sizer = PartSizer()
        self.uploaded = 0  # part bytes this merge sent

    # -------------------------------------------------------------------------- protocol

    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        local = self.target.staging / "directory"
        local.mkdir(parents=True, exist_ok=True)
        journal = self._journal(output, options.resume)
        try:
            self._upload_and_publish(output, local, journal, options)
            self._finish(local, journal)  # published: whatever fails now removes nothing
        finally:
            journal.release()
            shutil.rmtree(local, ignore_errors=True)
        log.info("uploaded %s of parts to %s", human(self.uploaded), self.target.uri)

    def _upload_and_publish(
        self, output: Output, local: Path, journal: Journal, options: WriteOptions
    ) -> None:
        """Every file uploaded, then published (`_publish`); any failure before the index is
        published removes what this merge made (module docstring), but a resumed merge refused
        at publishing keeps the interrupted merge's journal and uploads (`PrefixTaken`)."""
        # each file's, as its staging file is filled (`sinks.manifest`)
        hashes = new_hashes(options.manifest_hash)
        done: list[str] = []  # what this merge made, or may have (recorded before the request)
        try:
            with (
                progress(output.plan.total_bytes, "uploading", options.quiet) as update,
                ReadCache() as reader,
                ThreadPoolExecutor(UPLOADS) as pool,
            ):
                for pf in output.plan.files:
                    self._upload_file(pf, output.sources, reader, pool, journal, update, hashes)
            write_index(output.plan, local)
            if output.companions is not None:
                write_companions(output.companions, output.dtype, local)
            self._manifest(output, local, hashes)
            check_pins()  # every input still the version read (io.pins)
            self._publish(output, local, journal, options, done)
        except PrefixTaken:
            if not journal.resumed:
                journal.abort_all(self._remove(done)).report(self.target.uri)
            raise
        except BaseException:
            cleanup = self._remove(done)  # first: the journal is the record of a kill meanwhile
            journal.abort_all(cleanup).report(self.target.uri)
            raise

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        """The uploaded weight files read back into the staging area (with the index about to
        be published), then compared by the safetensors library as a local output is
        (`sinks.verify`)."""
        folder = self.target.staging / "verify"
        folder.mkdir(parents=True, exist_ok=True)
        names = [pf.name for pf in output.plan.files]
        try:
            write_index(output.plan, folder)  # the index to publish (not uploaded yet)
            with storage_errors(self.target.uri, self.target.storage_options):
                self.target.fs.get(
                    [self.target.uri.child(n).path for n in names], [str(folder / n) for n in names]
                )
            return verify_output(output.plan, output.sources, folder, progress, output.tied)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        return HfDirectorySink().files(output, out)

    def describe(self, output: Output, out: Path) -> list[str]:
        """The local directory's description, for the prefix: no free disk to check there,
        the local staging instead."""
        lines = [
            line for line in super().describe(output, out)[1:] if not line.startswith("free disk")
        ]
        largest = max((t.spec.nbytes for _, t in output.plan.tensors()), default=0)
        return [
            f"output: {self.target.uri} (format hf, multipart uploads)",
            *lines,
            f"local staging: up to {human(largest)} (the largest tensor) + {UPLOADS} parts",
        ]

    # ----------------------------------------------------------------------------- upload

    def _journal(self, output: Output, resume: bool) -> Journal:
        """This merge's journal: a new one under its own key, or with --resume the newest
        journal beside the prefix of the same plan and inputs, taken over (`check_target` has
        refused a live merge's)."""
        fp = resume_fingerprint(output)
        found = Journal.found(self.store) if resume else []
        refusals = [
            resume_refused(self.target.uri, data.get("fingerprint"), fp) for _, data in found
        ]
        same = [kept for kept, refused in zip(found, refusals, strict=True) if refused is None]
        if found and not same:  # the newest journal says what changed
            assert refusals[-1] is not None
            raise refusals[-1]
        journal = Journal(self.store, fp, same[-1][0] if same else "")
        if same:
            left = same[-1][1]
            journal.resumed = True
            journal.puts = [str(n) for n in left.get("put") or []]
            for name, e in dict(left.get("files") or {}).items():
                journal.files[name] = FileUpload(
                    str(e["upload_id"]),
                    int(e["part_size"]),
                    completed=e.get("completed"),
                    completing=bool(e.get("completing")),
                    digests=_digests(e),
                )
            log.info("resuming the interrupted merge to %s", self.target.uri)
        elif resume:
            log.info("--resume: nothing to resume at %s; merging from the start", self.target.uri)
        journal.save()
        return journal

    def _manifest(self, output: Output, local: Path, hashes: Hashes | None) -> None:
        """The integrity manifest, put last (`_publish`): every file hashed as its staging
        file was filled (by this merge, or by the interrupted one that completed it)."""
        if hashes is None:
            return
        if len(hashes) < len(output.plan.files):  # completed by a merge that kept no hash
            log.info("no %s: an interrupted merge's files were kept unhashed", MANIFEST_NAME)
            return
        sizes = {pf.name: pf.size for pf in output.plan.files}
        write_manifest(local, hashes, output.sources.values(), sizes)

    def _kept(self, pf: PlannedFile, up: FileUpload) -> dict[int, str] | None:
        """What an interrupted merge left of `pf`: None when the file is complete (size and
        ETag checked), else the parts whose size is the planned one; a new upload (no parts)
        where its upload is gone (a completion the interrupted merge did not record)."""
        if up.completed is not None and self._unchanged(pf, up.completed):
            return None
        parts = self.store.parts(pf.name, up.upload_id) if up.completed is None else None
        if parts is None:
            up.completed = None
            up.upload_id = self.store.create(pf.name)
            return {}
        ranges = part_ranges(pf.size, up.part_size)
        return {
            n: etag
            for n, (size, etag) in parts.items()
            if n <= len(ranges) and size == ranges[n - 1][1] - ranges[n - 1][0]
        }

    def _unchanged(self, pf: PlannedFile, etag: str) -> bool:
        """Whether the object of `pf` is the one completed with `etag` (size checked too)."""
        try:
            head = self.store.on_object("head_object", pf.name)
        except StorageError as exc:
            if exc.kind == "missing":  # removed since
                return False
            raise
        return int(head["ContentLength"]) == pf.size and str(head["ETag"]) == etag

    def _upload_file(
        self,
        pf: PlannedFile,
        sources: Mapping[str, TensorSource],
        reader: ReadCache,
        pool: ThreadPoolExecutor,
        journal: Journal,
        update: Progress,
        hashes: Hashes | None = None,
    ) -> None:
        up = journal.files.get(pf.name)
        if up is None:
            up = FileUpload(self.store.create(pf.name), self.sizer.size_for(pf.size))
            journal.files[pf.name] = up
            journal.save()
            kept: dict[int, str] | None = {}
        else:
            started = up.upload_id
            kept = self._kept(pf, up)
            if up.upload_id != started:
                journal.save()
        if kept is None:  # completed by the interrupted merge, and unchanged
            update(pf.size)
            if hashes is not None and up.digests.get(hashes.algo) is not None:
                hashes[pf.name] = up.digests[hashes.algo]
            return
        up.etags = dict(kept)
        staged = self.target.staging / pf.name
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            h = hashes.start(pf.name, staged) if hashes is not None else None
            os.ftruncate(fd, pf.size)
            with hashing(fd, h):
                _Parts(self, pf, up, fd, pool).fill(sources, reader, update)
        finally:
            os.close(fd)
            staged.unlink(missing_ok=True)  # (the hash holds it open until its digest)
        if hashes is not None and h is not None:
            up.digests = {h.algo: h.hexdigest(pf.size)}
            hashes[pf.name] = up.digests[h.algo]
            journal.save()

    def _send(self, name: str, up: FileUpload, number: int, body: FileRange) -> str:
        import time

        start = time.monotonic()
        etag = self.store.upload(name, up.upload_id, number, body)
        self.sizer.measured(len(body), time.monotonic() - start)
        return etag

    # ---------------------------------------------------------------------------- publish

    def _publish(
        self,
        output: Output,
        local: Path,
        journal: Journal,
        options: WriteOptions,
        done: list[str],
    ) -> None:
        """Make the output visible in the order of the module docstring."""
        plan = output.plan
        # what the interrupted merge this one resumes completed, or may have
        ours = {n for n, f in journal.files.items() if f.completed is not None or f.completing}
        ours |= set(journal.puts)  # what it put, or was putting (recorded before the requests)
        before = {self._name(o["Key"]) for o in self.store.objects()} - ours
        if before and not options.overwrite:
            raise PrefixTaken(self.target.uri, sorted(before), journal.resumed)
        if before and options.model_only:  # what appeared meanwhile counts too
            refuse_non_model(self.target.uri, before)
        for name in (SAFE_WEIGHTS_INDEX_NAME, MANIFEST_NAME):
            if name in before:  # the previous model is unpublished first
                self.store.delete(self.store.key(name))
        last = SAFE_WEIGHTS_INDEX_NAME if plan.index is not None else SAFE_WEIGHTS_NAME
        for pf in plan.files:
            if pf.name != last:
                self._complete(pf.name, journal, done)
        extra = sorted(p.name for p in local.iterdir() if p.is_file())
        journal.puts = extra  # a resumed merge counts them as its own (a kill from now on)
        journal.save()
        for name in extra:
            if name not in (last, MANIFEST_NAME):
                done.append(name)
                self.store.put(name, (local / name).read_bytes())
        if options.verify and plan.index is not None:
            self._verified(output, options.quiet)
        new = {pf.name for pf in plan.files} | set(extra)
        for name in sorted(before - new):
            self.store.delete(self.store.key(name))
        if last == SAFE_WEIGHTS_INDEX_NAME:
            done.append(last)
            self.store.put(last, (local / last).read_bytes())
        else:
            self._complete(last, journal, done)
            if options.verify:  # unsharded: the weights file itself is what publishes
                self._verified(output, options.quiet)

    def _finish(self, local: Path, journal: Journal) -> None:
        """Once the model is published: its manifest put, then the journal removed, each
        request tried again (`uploads.Cleanup`). Whatever fails now removes nothing: the
        journal stays until the manifest is put, and `--resume` (or a later merge) finishes."""
        tries = Cleanup()
        manifest = local / MANIFEST_NAME
        if manifest.is_file():
            body = manifest.read_bytes()
            tries(f"put {MANIFEST_NAME}", functools.partial(self.store.put, MANIFEST_NAME, body))
        if not tries.failed:
            tries("delete the journal", journal.delete)
            tries.report(self.target.uri, "the model is published; --resume or a later merge")
            return
        raise StorageError(
            f"{self.target.uri}: the model is published, but its {MANIFEST_NAME} could not be "
            f"put ({tries.failed[0]}); the merge's journal is kept beside it: run the same "
            "merge with --resume to put it (nothing is uploaded again)"
        )

    def _complete(self, name: str, journal: Journal, done: list[str]) -> None:
        """Complete `name`'s upload, recorded in `done` before the request (the cleanup then
        deletes it whenever the request is interrupted)."""
        up = journal.files[name]
        done.append(name)
        if up.completed is None:
            up.completing = True  # a resumed merge finds it (`_kept`) if a kill comes now
            journal.save()
            up.completed = self.store.complete(name, up.upload_id, up.etags)
            journal.save()

    def _verified(self, output: Output, quiet: bool) -> None:
        with progress(output.plan.total_bytes, "verifying", quiet) as update:
            n = self.verify(output, self.target.staging, update)
        log.info("%s", verified_line(n, output))

    def _name(self, key: str) -> str:
        return key[len(self.target.uri.key) + 1 :]

    def _remove(self, done: list[str]) -> Cleanup:
        """Remove what this merge completed or put, or was doing so (`uploads.Cleanup`: a
        failure is on its way, nothing is raised)."""
        cleanup = Cleanup()
        for name in dict.fromkeys(done):
            cleanup(f"delete {name}", functools.partial(self.store.delete, self.store.key(name)))
        return cleanup


class _Parts:
    """One file's parts: filled in its staging file, then uploaded from it (`UPLOADS` at a
    time, each read from the file as it is sent) and their blocks given back once sent."""

    def __init__(
        self,
        sink: ObjectStoreSink,
        pf: PlannedFile,
        up: FileUpload,
        fd: int,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.sink, self.pf, self.up, self.fd, self.pool = sink, pf, up, fd, pool
        self.ranges = part_ranges(pf.size, up.part_size)
        self.next = 0  # the next part to send
        self.pending: deque[tuple[int, Future[str]]] = deque()

    def _needed(self, start: int, stop: int) -> bool:
        """Whether [start, stop) overlaps a part still to upload."""
        return any(
            a < stop and start < b
            for n, (a, b) in enumerate(self.ranges, 1)
            if n not in self.up.etags
        )

    def fill(
        self, sources: Mapping[str, TensorSource], reader: ReadCache, update: Progress
    ) -> None:
        try:
            self._fill(sources, reader, update)
            while self.pending:
                self._settle()
        except BaseException:
            self._drain()  # no upload may read the staging file once it is closed
            raise

    def _fill(
        self, sources: Mapping[str, TensorSource], reader: ReadCache, update: Progress
    ) -> None:
        header = self.pf.header
        pwrite_all(self.fd, memoryview(header), 0)
        update(len(header))
        hashed = hash_of(self.fd) is not None  # every tensor written, uploaded parts too
        for t in sorted(self.pf.tensors, key=lambda t: t.offset):
            if hashed or self._needed(t.offset, t.offset + t.spec.nbytes):
                src = sources[t.spec.name]
                src.write(reader, Destination(self.fd, t.offset, t.spec.dtype, update))
            else:
                update(t.spec.nbytes)
            self._send_ready(t.offset + t.spec.nbytes)
        self._send_ready(self.pf.size)

    def _send_ready(self, frontier: int) -> None:
        while self.next < len(self.ranges) and self.ranges[self.next][1] <= frontier:
            number = self.next + 1
            a, b = self.ranges[self.next]
            self.next += 1
            if number in self.up.etags:
                continue
            while len(self.pending) >= UPLOADS:
                self._settle()
            body = FileRange(self.fd, a, b)
            name, up = self.pf.name, self.up
            self.pending.append((number, self.pool.submit(self.sink._send, name, up, number, body)))
            self.sink.uploaded += b - a

    def _settle(self) -> None:
        """Wait for the oldest upload in flight; its blocks of the staging file go back (once
        the file's hash has read them: `io.digest.FileHash.wait_hashed`)."""
        number, fut = self.pending.popleft()
        self.up.etags[number] = fut.result()
        a, b = self.ranges[number - 1]
        h = hash_of(self.fd)
        if h is not None:
            h.wait_hashed(b)
        punch_hole(self.fd, a, b - a)

    def _drain(self) -> None:
        """A failure: the uploads not started are cancelled, the running ones waited for."""
        for _, fut in self.pending:
            fut.cancel()
        for _, fut in self.pending:
            with contextlib.suppress(BaseException):  # the failure on its way is the one raised
                fut.exception()
        self.pending.clear()


def _digests(entry: Mapping[str, Any]) -> dict[str, str]:
    """A journal entry's digests by hash name (a journal of an earlier version: its SHA-256)."""
    found = entry.get("digests")
    if isinstance(found, dict):
        return {k: v for k, v in found.items() if k in ALGORITHMS and isinstance(v, str)}
    sha = entry.get("sha256")
    return {"sha256": sha} if isinstance(sha, str) else {}
