"""What makes a merge resumable: the fingerprint of what it writes, and the journal of the files
it finished in its hidden directory (a local output).

Every local Hugging Face directory write keeps ``.shardforge-resume.json`` in its hidden
directory: the fingerprint, and for each finished file (written and fsynced) its size and
SHA-256: the one computed as it was written for the integrity manifest (`sinks.manifest`),
else hashed on a thread while the next file is written. The journal is removed just before
the directory is published. A merge killed with SIGKILL leaves the hidden directory behind;
`--resume` takes it over (`io.publish`), keeps every finished file whose size and hash still
match and rewrites the others. The object-store sink keeps its own journal beside the prefix
(`sinks.uploads`) with the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardforge.errors import MergeError
from shardforge.io.mirror import public_name
from shardforge.sinks.plan import OutputPlan, PlannedFile

log = logging.getLogger("shardforge")

JOURNAL_NAME = ".shardforge-resume.json"


def fingerprint(plan: OutputPlan, inputs: Iterable[str]) -> str:
    """What a resumed merge must share with the interrupted one: the planned files (names,
    headers, sizes) and the checkpoint folders read."""
    h = hashlib.sha256()
    for pf in plan.files:
        h.update(pf.name.encode() + b"\0" + pf.header + str(pf.size).encode() + b"\0")
    for name in sorted({public_name(i) for i in inputs}):
        h.update(name.encode() + b"\0")
    return h.hexdigest()


def sha256_of(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class LocalJournal:
    """The finished files of one hidden output directory (see the module docstring)."""

    def __init__(self, directory: Path, fp: str, resume: bool) -> None:
        self.directory, self.fingerprint = directory, fp
        self.path = directory / JOURNAL_NAME
        self.finished: dict[str, dict[str, Any]] = {}
        self._hashing: dict[str, Future[str]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardforge-hash")
        left = self._load() if resume else None
        if left is not None:
            if left.get("fingerprint") != fp:
                raise MergeError(
                    f"{directory}: --resume: the interrupted merge planned other files or read "
                    "other inputs; merge without --resume to start over"
                )
            self.finished = dict(left.get("files") or {})
        self._save()

    def _load(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "files": self.finished}))
        os.replace(tmp, self.path)

    def kept(self, pf: PlannedFile) -> bool:
        """Whether the interrupted merge finished `pf` and it is unchanged (size and SHA-256);
        otherwise any partial file of it is removed, to be written again."""
        path = self.directory / pf.name
        entry = self.finished.get(pf.name)
        if entry is not None and path.is_file() and path.stat().st_size == pf.size:
            if sha256_of(path) == entry.get("sha256"):
                return True
            log.info("%s: changed since the interrupted merge wrote it; writing it again", pf.name)
        self.finished.pop(pf.name, None)
        path.unlink(missing_ok=True)
        return False

    def finish(self, pf: PlannedFile, digest: str | None = None) -> None:
        """`pf` is written and fsynced: record it with `digest`, its SHA-256 computed as it was
        written (`sinks.manifest`), else hash it on the journal's thread."""
        self._collect()
        if digest is not None:
            self.finished[pf.name] = {"size": pf.size, "sha256": digest}
            self._save()
            return
        self._hashing[pf.name] = self._pool.submit(sha256_of, self.directory / pf.name)

    def digest(self, name: str) -> str:
        """The SHA-256 recorded for a kept file (`kept`)."""
        return str(self.finished[name]["sha256"])

    def _collect(self, wait: bool = False) -> None:
        for name, fut in list(self._hashing.items()):
            if wait or fut.done():
                size = (self.directory / name).stat().st_size
                self.finished[name] = {"size": size, "sha256": fut.result()}
                del self._hashing[name]
                self._save()

    def close(self) -> None:
        """Every hash recorded; the journal removed (the directory is about to be published)."""
        self._collect(wait=True)
        self._pool.shutdown()
        self.path.unlink(missing_ok=True)
