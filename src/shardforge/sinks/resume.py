"""What makes a merge resumable: the fingerprint of what it writes and reads, and the journal of
the files it finished in its hidden directory (a local output).

The fingerprint is the plan's SHA-256 and, for every input file, its pin (`io.pins`: a local
file's device, inode, size and mtime; an object's ETag and VersionId) and the SHA-256 of what
the manifest records of it (its records' CRC-32s, a `.metadata`'s or an index's SHA-256): not
the inputs' names alone. `--resume` over a checkpoint that was replaced since (another save of
the same shapes, a file rewritten) is refused, naming each file that changed and how (`_PLACE`:
a copy or a remount, which number devices and inodes anew, is not a change); the refusal
(`ResumeRefused`) keeps what the interrupted merge left.

Every local Hugging Face directory write keeps ``.shardforge-resume.json`` in its hidden
directory: the fingerprint, and for each finished file (written and fsynced) its size and
digest under the name of its hash (``"blake3"`` or ``"sha256"``): the one taken from its
written bytes for the integrity manifest (`sinks.manifest`), else its BLAKE3, each taken on a
thread while the next file is written. The journal is removed just before
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
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardforge.errors import ResumeRefused
from shardforge.formats.base import TensorSource
from shardforge.io.copy import session_memo
from shardforge.io.digest import ALGORITHMS, BLAKE3, FileHash, hash_file
from shardforge.io.mirror import public_name
from shardforge.io.pins import pin, what_changed
from shardforge.sinks.manifest import source_files
from shardforge.sinks.plan import OutputPlan, PlannedFile

log = logging.getLogger("shardforge")

JOURNAL_NAME = ".shardforge-resume.json"


Fingerprint = dict[str, Any]  # {"plan": SHA-256, "inputs": {file: {"pin": ..., "content": ...}}}


def fingerprint(plan: OutputPlan, inputs: Mapping[str, Mapping[str, Any]]) -> Fingerprint:
    """What a resumed merge must share with the interrupted one: the planned files (names,
    headers, sizes) and every input file's identity and content (`pinned_inputs`)."""
    h = hashlib.sha256()
    for pf in plan.files:
        h.update(pf.name.encode() + b"\0" + pf.header + str(pf.size).encode() + b"\0")
    return {"plan": h.hexdigest(), "inputs": {k: dict(v) for k, v in inputs.items()}}


def pinned_inputs(sources: Iterable[TensorSource]) -> dict[str, dict[str, Any]]:
    """Every file the sources are read from, pinned (`io.pins`: checked at every open and
    before publishing), by its public name (an object's URI): its pin (a local file's device,
    inode, size and mtime; an object's ETag) and the SHA-256 of what the manifest records of
    it (its records' stored CRC-32s; a `.metadata`'s or an index's own SHA-256). Once per
    `io.copy.fact_session`."""
    sources = list(sources)
    where = tuple(sorted({str(s.directory.absolute()) for src in sources for s in src.stored()}))

    def compute() -> dict[str, dict[str, Any]]:
        found = {}
        for path, entry in source_files(sources):
            content = hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()
            found[public_name(str(path))] = {"pin": pin(path).describe(), "content": content}
        return found

    return session_memo(("pinned inputs", where), compute)


# a local file's pin fields that say where it is, not what it holds: a copy, a remount (NFS,
# Lustre, FUSE and container mounts number devices and inodes anew) changes them; across
# processes the content, size and mtime decide (`io.pins` checks them all within one)
_PLACE = frozenset({"device", "inode", "ctime_ns"})


def resume_refused(where: object, left: object, fp: Fingerprint) -> ResumeRefused | None:
    """Why the interrupted merge's fingerprint `left` is not `fp` (None: it is): the error
    names each input that changed, and how. What the interrupted merge left is kept."""
    again = (
        "its finished files are kept: --resume again once the checkpoint is the one it read, "
        "or merge without --resume to start over"
    )
    if not isinstance(left, dict) or left.get("plan") != fp["plan"]:
        return ResumeRefused(
            f"{where}: --resume refused: the interrupted merge planned other files (or another "
            "shardforge version wrote it); merge without --resume to start over"
        )
    found = _inputs_changed(left.get("inputs") or {}, fp["inputs"])
    if not found:
        return None
    return ResumeRefused(
        f"{where}: --resume refused: the checkpoint is not what the interrupted merge read "
        f"({len(found)} file{'s' if len(found) > 1 else ''} changed, listed below); {again}",
        found,
    )


def _content(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What an input's fingerprint entry says of its content (not of where it is stored)."""
    pin = {k: v for k, v in dict(entry.get("pin") or {}).items() if k not in _PLACE}
    return {"pin": pin, "content": entry.get("content")}


def _inputs_changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    found = []
    for name in sorted(set(before) | set(now)):
        was, new = before.get(name), now.get(name)
        if not isinstance(was, dict):
            found.append(f"{name} was not read by the interrupted merge")
        elif new is None:
            found.append(f"{name} was read by the interrupted merge, not by this one")
        elif _content(was) != _content(new):
            how = [what_changed(_content(was)["pin"], _content(new)["pin"])]
            if was.get("content") != new["content"]:
                how.append("its content differs (records' CRC-32 or SHA-256)")
            found.append(
                f"{name} changed since the interrupted merge read it: "
                + "; ".join(h for h in how if h)
            )
    return found


class LocalJournal:
    """The finished files of one hidden output directory (see the module docstring)."""

    def __init__(self, directory: Path, fp: Fingerprint, resume: bool) -> None:
        self.directory, self.fingerprint = directory, fp
        self.path = directory / JOURNAL_NAME
        self.finished: dict[str, dict[str, Any]] = {}
        self._hashing: dict[str, Future[None]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardforge-journal")
        left = self._load() if resume else None
        if left is not None:
            refused = resume_refused(directory, left.get("fingerprint"), fp)
            if refused is not None:
                raise refused
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
        """Whether the interrupted merge finished `pf` and it is unchanged (size and digest);
        otherwise any partial file of it is removed, to be written again."""
        path = self.directory / pf.name
        entry = self.finished.get(pf.name)
        if entry is not None and path.is_file() and path.stat().st_size == pf.size:
            algo = next((a for a in ALGORITHMS if a in entry), None)
            if algo is not None and hash_file(path, algo) == entry[algo]:
                return True
            log.info("%s: changed since the interrupted merge wrote it; writing it again", pf.name)
        self.finished.pop(pf.name, None)
        path.unlink(missing_ok=True)
        return False

    def finish(self, pf: PlannedFile, h: FileHash | None = None) -> None:
        """`pf` is written and fsynced: record it with its digest, taken on the journal's
        thread from `h` (its written bytes, hashed for the manifest: `sinks.manifest`), else
        its BLAKE3 from the file; the journal is saved once it is known."""
        self._collect()
        self._hashing[pf.name] = self._pool.submit(self._record, pf, h)

    def _record(self, pf: PlannedFile, h: FileHash | None) -> None:
        if h is not None:
            entry = {"size": pf.size, h.algo: h.hexdigest(pf.size)}
        else:
            entry = {"size": pf.size, BLAKE3: hash_file(self.directory / pf.name, BLAKE3)}
        with self._lock:
            self.finished[pf.name] = entry
            self._save()

    def digest(self, name: str, algo: str) -> str:
        """The `algo` digest of a kept file (`kept`): recorded, else taken now."""
        recorded = self.finished[name].get(algo)
        return str(recorded) if recorded else hash_file(self.directory / name, algo)

    def _collect(self, wait: bool = False) -> None:
        """Raise the first failure of a finished recording (with `wait`: of every one)."""
        for name, fut in list(self._hashing.items()):
            if wait or fut.done():
                del self._hashing[name]
                fut.result()

    def close(self) -> None:
        """Every hash recorded; the journal removed (the directory is about to be published)."""
        self._collect(wait=True)
        self._pool.shutdown()
        self.path.unlink(missing_ok=True)
