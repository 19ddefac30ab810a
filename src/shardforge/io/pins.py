"""Inputs pinned from the plan to the last byte: a merge reads one version of every input file,
or refuses.

    with pin_session():           # one merge (nested blocks join the outer one)
        fd = open_regular(path)   # io.files: every open is `opened`: first seen, or checked
        pin(path)                 # at the plan: the file's identity (as first opened)
        check_and_release()       # before publishing (io.publish, the object-store sink)

A local file is pinned by (device, inode, size, modification time in ns), taken when the merge
first opened it (its `.metadata` is parsed before the plan) or else when the plan is made; every
later open of it is checked against the pin (the copy jobs open each data file anew), and so is
every pinned path before the output is published (`check_all`): a file replaced (another
inode), rewritten in place (another mtime) or cut is one `error:` line naming it, and nothing
is published. A file of a mirrored object-storage prefix (`io.mirror`) is pinned by the ETag
(and VersionId, where the listing has one) its listing gave: every ranged GET of it carries
``If-Match`` (`io.remote`), and `check_all` asks the store for each pinned object's ETag once
more (one HEAD each, concurrently). `Pin.describe` is what `--resume`'s fingerprint records
(`sinks.resume`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.io.mirror import mirrored_object
from shardforge.io.remote import RemoteObject, changed_objects
from shardforge.io.remote import changed_error as changed

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
_FIELDS = ("device", "inode", "size", "mtime_ns")


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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
        return dict(zip(_FIELDS, self.local, strict=True))


def what_changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """Two `Pin.describe`s' differences, in words (empty: none)."""
    names = {"etag": "ETag", "version_id": "VersionId", "mtime_ns": "mtime (ns)"}
    return ", ".join(
        f"{names.get(k, k)} {before.get(k)} -> {now.get(k)}"
        for k in sorted(set(before) | set(now))
        if before.get(k) != now.get(k)
    )


@dataclass
class _Pins:
    seen: dict[str, Identity] = field(default_factory=dict)  # first open, by real path
    pins: dict[str, Pin] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_SESSION: list[_Pins] = []


@contextmanager
def pin_session() -> Iterator[None]:
    """Within the block (nested blocks join the outer one) input files are pinned and
    checked; outside, `opened`, `pin` and `check_all` do nothing."""
    outer = not _SESSION
    if outer:
        _SESSION.append(_Pins())
    try:
        yield
    finally:
        if outer:
            _SESSION.clear()


def _local_change(before: Identity, now: Identity) -> str:
    return what_changed(
        dict(zip(_FIELDS, before, strict=True)), dict(zip(_FIELDS, now, strict=True))
    )


def opened(real: str, st: os.stat_result, name: object = None) -> None:
    """`real` (opened as `name`) is `st` now: checked against its pin, or remembered as first
    seen (`io.files.open_regular` calls this for every file it opens)."""
    if not _SESSION:
        return
    s, now = _SESSION[0], identity(st)
    with s.lock:
        pin = s.pins.get(real)
        if pin is None:
            s.seen.setdefault(real, now)
            return
    if pin.local != now:
        raise changed(real if name is None else name, _local_change(pin.local, now))


def pin(path: Path) -> Pin:
    """Pin the input file `path` (with the object it stands for, when mirrored: its listed
    ETag): its identity when first opened, else now; checked against now. Pinned already: that
    pin, checked. Outside a `pin_session` the identity now, remembered nowhere."""
    real = os.path.realpath(path)
    try:
        now = identity(os.stat(real))
    except OSError as exc:
        raise changed(path, f"cannot be read now: {exc.strerror or exc}") from None
    if not _SESSION:
        return Pin(real, now, mirrored_object(path))
    s = _SESSION[0]
    with s.lock:
        found = s.pins.get(real)
        if found is None:
            found = s.pins[real] = Pin(real, s.seen.pop(real, now), mirrored_object(path))
    if found.local != now:
        raise changed(path, _local_change(found.local, now))
    return found


def check_all() -> None:
    """Every pinned file is still what the merge read: local ones by their identity, the
    objects of a store by their ETag (one request each). The first change is raised."""
    if not _SESSION:
        return
    s = _SESSION[0]
    with s.lock:
        pins = list(s.pins.values())
    for p in pins:
        try:
            now = identity(os.stat(p.path))
        except OSError as exc:
            raise changed(p.path, f"cannot be read now: {exc.strerror or exc}") from None
        if now != p.local:
            raise changed(p.path, _local_change(p.local, now))
    for obj, how in changed_objects([p.remote for p in pins if p.remote is not None]):
        raise changed(obj.uri, how)


def check_and_release() -> None:
    """`check_all`, then the pins forgotten: the output is about to be published (the next
    merge of the same session, `--all_steps`' next step, pins its own inputs, and a checkpoint
    pruned meanwhile by its training run is no longer this session's concern)."""
    check_all()
    if _SESSION:
        s = _SESSION[0]
        with s.lock:
            s.pins.clear()
            s.seen.clear()
