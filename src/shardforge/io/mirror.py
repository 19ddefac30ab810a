"""Object-storage prefixes as local paths for one command: the staging area.

    with staging() as area:
        local = area.mirror("s3://bucket/run", storage_options)   # a folder the layouts scan
        out = area.output("s3://bucket/merged", storage_options)  # a path the sink publishes to

A mirror is a local folder with the prefix's tree. Only the small files a command reads are
downloaded whole, chosen by name and size (`fetched`): a DCP `.metadata`, JSON files (trainer
state, configs, indexes, adapter config), tokenizer files, verl's
`latest_checkpointed_iteration.txt`, a model's code files, and data files of at most
`DOWNLOAD_LIMIT` (Lightning's `meta.pt`, tiny shards), each up to the cap of its kind
(`FETCH_LIMITS`). Every other object is a sparse stand-in of its size that holds no byte on disk
and whose reads the byte path sends to the store by ranged requests (`io.remote`): the large
data files (`.distcp`, `.safetensors`, `.bin`, `.pt`), which the merge reads by byte ranges,
and whatever else a run's prefix holds (archives, logs, optimizer extras, a file above its
cap), which no command reads whole: a 400 MB `training_data.tar` beside a checkpoint costs
nothing. Each object is kept as listed, with its ETag: the version the merge pins and reads
(`io.pins`). The layouts, formats and the merge then find, check and read a remote checkpoint
exactly as a local one, and no checkpoint data is copied down. Disk: the small files only (plus
what a sink stages, `sinks.object_store`); the area is removed when the block ends, however it
ends.

Messages name the URI, not the staging folder: a `ShardforgeError` leaving the block has the
folder replaced by ``s3://`` in its lines, and so has every line the "shardforge" logger logs
within the block (`_PublicNames`); `public_path` gives a result path the same way. The active
areas are those of the current context (a context variable): a command on another thread of
the process neither sees nor uses them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.io.model_files import TOKENIZER_FILES
from shardforge.io.remote import (
    RemoteObject,
    RemoteURI,
    filesystem,
    forget_stand_ins,
    register_stand_in,
    storage_errors,
)

# names of data files read by byte ranges (stand-ins when large)
DATA_SUFFIXES = (".distcp", ".safetensors", ".bin", ".pt", ".pth")
# a data file at most this large is downloaded whole (fewer requests for tiny shards)
DOWNLOAD_LIMIT = 1 << 20
# the files a command reads whole, by name: the cap of each kind (a larger one is a stand-in,
# refused by its reader's own cap); anything else is never downloaded. Tokenizer files: those
# of `io.model_files.TOKENIZER_FILES`, and every *.model (sentencepiece), *.jinja (chat
# templates) and *.tiktoken file
FETCH_LIMITS = {
    "metadata": 32 << 20,  # a DCP .metadata: the allow-list unpickler's cap for it
    "json": 16 << 20,  # trainer_state.json, config.json, an index (`io.files.MAX_JSON_BYTES`)
    "tokenizer": 64 << 20,  # the largest tokenizer.json files are tens of MB
    "text": 1 << 20,  # latest_checkpointed_iteration.txt, a model's code (configuration_*.py)
}
LATEST_FILE = "latest_checkpointed_iteration.txt"  # verl's (layouts.layout.LATEST_FILE)
# the folder under which each staging area is made (default: the system's temporary folder)
STAGING_ENV = "SHARDFORGE_STAGING_DIR"
_SCHEME_DIR = "s3"


@dataclass(frozen=True)
class RemoteTarget:
    """An output prefix in a store: where an object-store sink publishes."""

    uri: RemoteURI
    fs: Any
    storage_options: Mapping[str, Any] | None
    staging: Path  # a local folder for what the sink stages


@dataclass
class StagingArea:
    root: Path
    stand_ins: list[tuple[int, int]] = field(default_factory=list)
    mirrors: dict[str, tuple[Path, Mapping[str, Any] | None]] = field(default_factory=dict)
    targets: dict[Path, RemoteTarget] = field(default_factory=dict)
    objects: dict[str, RemoteObject] = field(default_factory=dict)  # by real local path

    def local(self, uri: RemoteURI) -> Path:
        """The local path that stands for `uri` (its messages are rewritten back)."""
        return (
            self.root / _SCHEME_DIR / uri.bucket / uri.key
            if uri.key
            else (self.root / _SCHEME_DIR / uri.bucket)
        )

    def mirror(
        self, text: str, storage_options: Mapping[str, Any] | None = None, empty_ok: bool = False
    ) -> Path:
        """The local mirror of the prefix `text` (made once per area); an empty folder for an
        empty prefix when `empty_ok` (else that is an error)."""
        uri = RemoteURI.parse(text)
        if str(uri) not in self.mirrors:
            fs = filesystem(storage_options)
            local = self._stage(uri, fs, storage_options, empty_ok)
            self.mirrors[str(uri)] = (local, storage_options)
        return self.mirrors[str(uri)][0]

    def output(self, text: str, storage_options: Mapping[str, Any] | None = None) -> Path:
        """A local path standing for the output prefix `text` (nothing is created there)."""
        uri = RemoteURI.parse(text)
        path = self.local(uri)
        staging = Path(tempfile.mkdtemp(prefix="output-", dir=self.root))
        self.targets[path] = RemoteTarget(
            uri, filesystem(storage_options), storage_options, staging
        )
        return path

    def _stage(
        self, uri: RemoteURI, fs: Any, options: Mapping[str, Any] | None, empty_ok: bool
    ) -> Path:
        local = self.local(uri)
        with storage_errors(uri, options):
            fs.invalidate_cache(uri.path)  # what other processes wrote since the last listing
            listing = fs.find(uri.path, detail=True)
        objects = {p: i for p, i in listing.items() if i.get("type") != "directory"}
        if not objects and empty_ok:
            local.mkdir(parents=True, exist_ok=True)
            return local
        if not objects:
            raise CheckpointError(f"{uri}: nothing is stored under this prefix")
        downloads: list[tuple[str, Path]] = []
        for path, info in sorted(objects.items()):
            rel = uri.relative(path) if path != uri.path else uri.name
            target = _inside(local, rel, uri)
            target.parent.mkdir(parents=True, exist_ok=True)
            size = int(info.get("size") or 0)
            # the version listed is the one read (`io.pins`: If-Match on every ranged GET)
            obj = RemoteObject(
                fs, RemoteURI.parse(f"s3://{path}"), size, options, info.get("ETag"),
                info.get("VersionId"),
            )  # fmt: skip
            self.objects[os.path.realpath(target)] = obj
            if not fetched(target.name, size):
                self._stand_in(target, obj)
            else:
                downloads.append((path, target))
        if downloads:
            with storage_errors(uri, options):
                fs.get([p for p, _ in downloads], [str(t) for _, t in downloads])
        return local

    def _stand_in(self, target: Path, obj: RemoteObject) -> None:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            os.ftruncate(fd, obj.size)  # sparse: no block on disk
            st = os.fstat(fd)
        finally:
            os.close(fd)
        register_stand_in(st, obj)
        self.stand_ins.append((st.st_dev, st.st_ino))

    def rewrite(self, text: str) -> str:
        return text.replace(f"{self.root}/{_SCHEME_DIR}/", "s3://")

    def close(self) -> None:
        forget_stand_ins(self.stand_ins)
        shutil.rmtree(self.root, ignore_errors=True)


def fetched(name: str, size: int) -> bool:
    """Whether staging downloads the object `name` of `size` bytes whole: a file a command
    reads (by name, `FETCH_LIMITS`) or a data file of at most `DOWNLOAD_LIMIT`."""
    if name.endswith(DATA_SUFFIXES):
        return size <= DOWNLOAD_LIMIT
    if name in TOKENIZER_FILES or name.endswith((".tiktoken", ".jinja", ".model")):
        kind = "tokenizer"
    elif name.endswith(".metadata"):
        kind = "metadata"
    elif name.endswith(".json"):
        kind = "json"
    elif name == LATEST_FILE or name.endswith(".py"):
        kind = "text"
    else:
        return False
    return size <= FETCH_LIMITS[kind]


def _inside(local: Path, rel: str, uri: RemoteURI) -> Path:
    """`local / rel`, refused when a key would leave the mirror (`..`, an absolute name)."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(
            f"{uri}: holds the object {rel[:200]!r}, whose name leaves its folder; refusing it"
        )
    return local.joinpath(*parts)


# the staging areas of this context, innermost last: each thread (each command run on it) has
# its own; a thread a command starts for its work runs in a copy of its context (`io.pins`)
_ACTIVE: ContextVar[tuple[StagingArea, ...]] = ContextVar("shardforge_staging", default=())


def remote_target(path: Path | None) -> RemoteTarget | None:
    """The store prefix the local `path` stands for, when it is a staged output."""
    if path is None:
        return None
    for area in _ACTIVE.get():
        if path in area.targets:
            return area.targets[path]
    return None


def mirrored_object(path: Path) -> RemoteObject | None:
    """The object (as listed: its ETag) the mirrored local file `path` stands for, or was
    downloaded from (None: not a file of a mirror)."""
    for area in _ACTIVE.get():
        found = area.objects.get(os.path.realpath(path))
        if found is not None:
            return found
    return None


def mirrored(
    text: str, storage_options: Mapping[str, Any] | None = None, empty_ok: bool = False
) -> Path:
    """The local mirror of the prefix `text` in the innermost active staging area."""
    areas = _ACTIVE.get()
    if not areas:
        raise RuntimeError("mirrored() needs an active staging() block")
    return areas[-1].mirror(text, storage_options, empty_ok)


def public_name(text: str) -> str:
    """`text` with every active staging folder written as the URI it stands for."""
    for area in _ACTIVE.get():
        text = area.rewrite(text)
    return text


def public_path(path: Path) -> Path | str:
    """`path`, or the URI it stands for (``s3://bucket/prefix``, a str: as a Path its ``//``
    would fold) when it lies in an active staging area."""
    text = public_name(str(path))
    return path if text == str(path) else text


def remote_location(path: Path) -> tuple[RemoteURI, Mapping[str, Any] | None] | None:
    """The URI (and its storage options) of a mirrored local `path` (None: not mirrored)."""
    for area in _ACTIVE.get():
        for text, (local, options) in area.mirrors.items():
            if path == local or path.is_relative_to(local):
                rel = path.relative_to(local).as_posix()
                uri = RemoteURI.parse(text)
                return (uri.child(rel) if rel != "." else uri), options
    return None


class _PublicNames(logging.Filter):
    """Rewrites a log line's staging folders as the URIs they stand for."""

    def __init__(self, area: StagingArea) -> None:
        super().__init__()
        self.area = area

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        public = self.area.rewrite(message)
        if public != message:
            record.msg, record.args = public, None
        return True


def whole_copy(path: Path) -> Path:
    """`path`; for a file of a mirrored prefix, a whole local copy of its object instead: in
    the staging area, downloaded once per area by s3fs (not by the merge's ranged reads), for a
    reader that needs a real file (`--verify`'s ``torch.load(mmap=True)`` of a rank file)."""
    for area in _ACTIVE.get():
        for text, (local, options) in area.mirrors.items():
            if path == local or path.is_relative_to(local):
                rel = path.relative_to(local).as_posix()
                uri = RemoteURI.parse(text)
                uri = uri.child(rel) if rel != "." else uri
                copy = area.root / "whole" / uri.bucket / uri.key
                if not copy.is_file():
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    part = copy.with_name(copy.name + ".part")
                    with storage_errors(uri, options):
                        filesystem(options).get_file(uri.path, str(part))
                    part.replace(copy)
                return copy
    return path


def _rewritten(area: StagingArea, exc: ShardforgeError) -> None:
    exc.message = area.rewrite(exc.message)
    exc.details = [area.rewrite(d) for d in exc.details]
    exc.args = (exc.message, *exc.args[1:])


@contextlib.contextmanager
def staging() -> Iterator[StagingArea]:
    """A staging area for the block (see the module docstring)."""
    parent = os.environ.get(STAGING_ENV) or None
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    area = StagingArea(Path(tempfile.mkdtemp(prefix="shardforge-staging-", dir=parent)))
    token = _ACTIVE.set((*_ACTIVE.get(), area))
    names = _PublicNames(area)
    logger = logging.getLogger("shardforge")  # every module logs through this one logger
    logger.addFilter(names)
    try:
        yield area
    except ShardforgeError as exc:
        _rewritten(area, exc)
        raise
    finally:
        logger.removeFilter(names)
        _ACTIVE.reset(token)
        area.close()
