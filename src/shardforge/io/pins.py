"""Inputs pinned from the plan to the last byte: a merge reads one version of every input file,
or refuses.

    with pin_session() as pins:   # one merge (nested blocks join the outer one)
        fd = open_regular(path)   # io.files: every open is `opened`: first seen, or checked
        pin(path)                 # at the plan: the file's identity (as first opened)
        check_and_release()       # before publishing (io.publish, the object-store sink)

A session is a `PinSession` object, the current one held in a context variable: each thread
(and each merge in it) has its own, so two merges on two threads of one process each keep and
check their own pins. A thread the merge starts for its work (the copy jobs, the head start's
early copy) runs in a copy of the merge's context (`contextvars.copy_context`) and so in its
session; a thread started otherwise has none (its opens are not checked).

A local file is pinned by (device, inode, size, modification time and status change time in
ns), taken when the merge first opened it (its `.metadata` is parsed before the plan) or else
when the plan is made; every later open of it is checked against the pin (the copy jobs open
each data file anew), and so is every pinned path before the output is published
(`check_all`): a file replaced (another inode), rewritten in place (another mtime; or, with its
mtime set back by `touch -r` / `os.utime`, another ctime, which no user call can set back) or
cut is one `error:` line naming it, and nothing is published. A file of a mirrored
object-storage prefix (`io.mirror`) is pinned by the ETag (and VersionId, where the listing has
one) its listing gave: every ranged GET of it carries ``If-Match`` (`io.remote`), and
`check_all` asks the store for each pinned object's ETag once more (one HEAD each,
concurrently). `Pin.describe` is what `--resume`'s fingerprint records (`sinks.resume`): the
ctime is not in it (a copy or a `chmod` between two processes changes it; the fingerprint's
content hashes are the check across processes).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.io.mirror import mirrored_object
from shardforge.io.remote import RemoteObject, changed_objects
from shardforge.io.remote import changed_error as changed

Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
_FIELDS = ("device", "inode", "size", "mtime_ns", "ctime_ns")
_DESCRIBED = 4  # the fields `Pin.describe` records: not the ctime (see the module's doc)


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Pin:
    """One input file as the merge read it: its real path, its identity there, and the object
    it stands for when it is a mirrored file of a store."""

    path: str
    local: Identity
    remote: RemoteObject | None = None

    def describe(self) -> dict[str, Any]:
        """What identifies the file across processes (a resumed merge compares it): the
        object's ETag, VersionId and size; a local file's device, inode, size and mtime."""
        if self.remote is not None:
            found = {"etag": self.remote.etag, "size": self.remote.size}
            if self.remote.version_id:
                found["version_id"] = self.remote.version_id
            return found
        return dict(zip(_FIELDS[:_DESCRIBED], self.local[:_DESCRIBED], strict=True))


def what_changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """Two `Pin.describe`s' differences, in words (empty: none)."""
    names = {
        "etag": "ETag",
        "version_id": "VersionId",
        "mtime_ns": "mtime (ns)",
        "ctime_ns": "ctime (ns)",
    }
    found = ", ".join(
        f"{names.get(k, k)} {before.get(k)} -> {now.get(k)}"
        for k in sorted(set(before) | set(now))
        if before.get(k) != now.get(k)
    )
    if found.startswith("ctime") and "," not in found:  # only the ctime: mtime set back?
        found += " (changed in place with its mtime set back, or its permissions changed)"
    return found


def _stat(path: str, name: object) -> Identity:
    try:
        return identity(os.stat(path))
    except OSError as exc:
        raise changed(name, f"cannot be read now: {exc.strerror or exc}") from None


def _local_change(before: Identity, now: Identity) -> str:
    return what_changed(
        dict(zip(_FIELDS, before, strict=True)), dict(zip(_FIELDS, now, strict=True))
    )


@dataclass
class PinSession:
    """The pins of one merge: every input file's identity as first opened (`seen`) and as
    pinned at the plan (`pins`), by real path."""

    seen: dict[str, Identity] = field(default_factory=dict)
    pins: dict[str, Pin] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def opened(self, real: str, st: os.stat_result, name: object = None) -> None:
        """`real` (opened as `name`) is `st` now: checked against its pin, or remembered."""
        now = identity(st)
        with self.lock:
            found = self.pins.get(real)
            if found is None:
                self.seen.setdefault(real, now)
                return
        if found.local != now:
            raise changed(real if name is None else name, _local_change(found.local, now))

    def pin(self, path: Path) -> Pin:
        """`path` pinned (its identity when first opened, else now), checked against now."""
        real = os.path.realpath(path)
        now = _stat(real, path)
        with self.lock:
            found = self.pins.get(real)
            if found is None:
                found = self.pins[real] = Pin(real, self.seen.pop(real, now), mirrored_object(path))
        if found.local != now:
            raise changed(path, _local_change(found.local, now))
        return found

    def check_all(self) -> None:
        """Every pinned file is still what the merge read (the first change is raised)."""
        with self.lock:
            pins = list(self.pins.values())
        for p in pins:
            now = _stat(p.path, p.path)
            if now != p.local:
                raise changed(p.path, _local_change(p.local, now))
        for obj, how in changed_objects([p.remote for p in pins if p.remote is not None]):
            raise changed(obj.uri, how)

    def release(self) -> None:
        with self.lock:
            self.pins.clear()
            self.seen.clear()


# the merge's session in this context (a thread has its own; see the module's doc)
_CURRENT: ContextVar[PinSession | None] = ContextVar("shardforge_pins", default=None)


def current() -> PinSession | None:
    """The session of the merge running in this context (None: outside any)."""
    return _CURRENT.get()


@contextmanager
def pin_session() -> Iterator[PinSession]:
    """Within the block (nested blocks join the outer one) input files are pinned and
    checked; outside, `opened`, `pin` and `check_all` do nothing. Yields the session."""
    found = _CURRENT.get()
    if found is not None:
        yield found
        return
    session = PinSession()
    token = _CURRENT.set(session)
    try:
        yield session
    finally:
        _CURRENT.reset(token)


def opened(real: str, st: os.stat_result, name: object = None) -> None:
    """`real` (opened as `name`) is `st` now: checked against its pin, or remembered as first
    seen (`io.files.open_regular` calls this for every file it opens)."""
    session = _CURRENT.get()
    if session is not None:
        session.opened(real, st, name)


def pin(path: Path) -> Pin:
    """Pin the input file `path` (with the object it stands for, when mirrored: its listed
    ETag): its identity when first opened, else now; checked against now. Pinned already: that
    pin, checked. Outside a `pin_session` the identity now, remembered nowhere."""
    session = _CURRENT.get()
    if session is not None:
        return session.pin(path)
    real = os.path.realpath(path)
    return Pin(real, _stat(real, path), mirrored_object(path))


def check_all() -> None:
    """Every pinned file is still what the merge read: local ones by their identity, the
    objects of a store by their ETag (one request each). The first change is raised."""
    session = _CURRENT.get()
    if session is not None:
        session.check_all()


def check_and_release() -> None:
    """`check_all`, then the pins forgotten: the output is about to be published (the next
    merge of the same session, `--all_steps`' next step, pins its own inputs, and a checkpoint
    pruned meanwhile by its training run is no longer this session's concern)."""
    session = _CURRENT.get()
    if session is not None:
        session.check_all()
        session.release()
