"""A run whose output_dir is in object storage (``output_dir: s3://BUCKET/PREFIX``).

    remote = RemoteOutput.of(cfg)           # None: a local output_dir
    with checkpoint_folder(cfg) as folder:  # output_dir, or its mirror (io.mirror) for s3://
        ckpt.resolve_resume("auto", folder) # the layouts catalog lists the stored steps
    files = RunFiles(remote, local)         # rank 0: config, tokenizer, metrics, final save
    files.sync()                            # ... uploaded (changed files; indexes last)

Checkpoints are written straight to the store by torch DCP's fsspec writer (`writer`), each
rank's RNG file and, last, rank 0's trainer_state.json (`put`): a checkpoint whose
trainer_state.json is missing is incomplete, and the layouts catalog (which needs that marker)
never lists it, so resuming skips it. Everything else a run writes into output_dir (the model
config and tokenizer, metrics.jsonl, TensorBoard's and W&B's files, the LoRA adapter or the
FULL_STATE_DICT model) is written into a local folder and uploaded by `RunFiles.sync`: after
the run's start, after every checkpoint and at the end. Reading (resume) goes through the
mirror: every record is read by ranged requests and checked as for a local checkpoint
(`formats.dcp.reader.load_checked`, the allow-list unpickler), never by torch's unpickler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import StorageError
from shardforge.io.mirror import STAGING_ENV, mirrored, staging
from shardforge.io.remote import (
    RemoteURI,
    filesystem,
    fsspec_options,
    is_remote,
    storage_errors,
)

log = logging.getLogger("shardforge")

# a file whose name ends so is uploaded after the others of a sync (what it lists comes first)
INDEX_SUFFIX = ".index.json"
# the files a resumed run continues (metrics rows, the W&B run id), downloaded at its start
CONTINUED = ("metrics.jsonl", "tracking.json")
# what a run in object storage cannot do (checked before any rank starts: `problems`)
UNSUPPORTED = {
    "merge_on_save": "merge a stored checkpoint afterwards with merge-sharded-fsdp-weights "
    "--checkpoint s3://... --output_path s3://...",
    "async_save": "torch DCP's fsspec writer saves synchronously only; drop async_save",
}


@dataclass
class RemoteOutput:
    """output_dir in a store: where checkpoints are written and run files uploaded."""

    uri: RemoteURI
    storage_options: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, cfg: ShardforgeConfig) -> RemoteOutput | None:
        if not is_remote(cfg.output_dir):
            return None
        return cls(RemoteURI.parse(cfg.output_dir), cfg.storage_options)

    def __str__(self) -> str:
        return str(self.uri)

    @cached_property
    def fs(self) -> Any:
        return filesystem(self.storage_options)

    def url(self, rel: str) -> str:
        return str(self.uri.child(rel))

    def writer(self, rel: str) -> Any:
        """torch DCP's fsspec writer for the folder `rel` of output_dir."""
        # torch's own fsspec writer (exported as torch.distributed.checkpoint.FsspecWriter)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.url(rel), **fsspec_options(self.storage_options))

    def put(self, rel: str, data: bytes) -> None:
        """Store `data` as the object `rel` of output_dir (one request: it is complete or
        absent)."""
        with storage_errors(self.url(rel), self.storage_options):
            self.fs.pipe_file(self.uri.child(rel).path, data)

    def upload(self, local: Path, rel: str) -> None:
        with storage_errors(self.url(rel), self.storage_options):
            self.fs.put_file(str(local), self.uri.child(rel).path)

    def remove(self, rel: str, first: str | None = None) -> None:
        """Remove the object or folder `rel` (nothing when absent); `first`, an object inside
        it, goes before the rest (a checkpoint's marker: a half-removed one is incomplete)."""
        path = self.uri.child(rel).path
        with storage_errors(self.url(rel), self.storage_options):
            self.fs.invalidate_cache(path)
            if first is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(f"{path}/{first}")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)

    def download(self, rel: str, local: Path) -> bool:
        """The object `rel` into `local`; False when there is none."""
        try:
            with storage_errors(self.url(rel), self.storage_options):
                self.fs.get_file(self.uri.child(rel).path, str(local))
        except StorageError as exc:
            if exc.kind == "missing":
                return False
            raise
        return True


def checkpoint_name(path: Path) -> str:
    """A checkpoint of the mirror of a stored output_dir as its URI (for messages)."""
    from shardforge.io.mirror import public_name

    return public_name(str(path))


@contextlib.contextmanager
def checkpoint_folder(cfg: ShardforgeConfig) -> Iterator[Path]:
    """output_dir as a local folder to find and read checkpoints in: itself, or for an s3://
    output_dir its mirror (`io.mirror`: small files downloaded, data files read by ranged
    requests), for the block. Messages of errors leaving the block name the URI."""
    if not is_remote(cfg.output_dir):
        yield Path(cfg.output_dir)
        return
    with staging():
        yield mirrored(cfg.output_dir, cfg.storage_options, empty_ok=True)


def local_folder() -> Path:
    """A new local folder for the files of a run in a store (`RunFiles`)."""
    parent = os.environ.get(STAGING_ENV) or None
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="shardforge-run-", dir=parent))


@dataclass
class RunFiles:
    """Rank 0: the files a run writes into output_dir, written into `local` and uploaded to
    the store by `sync` (see the module docstring)."""

    remote: RemoteOutput
    local: Path
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, mtime)

    def fetch_continued(self) -> None:
        """A resumed run: the files it continues, downloaded (where stored)."""
        for name in CONTINUED:
            if self.remote.download(name, self.local / name):
                self._mark(name)

    def _mark(self, name: str) -> None:
        st = (self.local / name).stat()
        self.sent[name] = (st.st_size, st.st_mtime_ns)

    def sync(self) -> None:
        """Upload the new and changed files, index files last, after removing the stored copy
        of every file removed here since (a previous save's index first): a reader never finds
        an index whose files are not all stored."""
        now = {
            p.relative_to(self.local).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in self.local.rglob("*")
            if p.is_file()
        }
        gone = sorted(set(self.sent) - set(now), key=lambda n: not n.endswith(INDEX_SUFFIX))
        for name in gone:
            self.remote.remove(name)
            del self.sent[name]
        changed = [n for n, st in now.items() if self.sent.get(n) != st]
        for name in sorted(changed, key=lambda n: (n.endswith(INDEX_SUFFIX), n)):
            self.remote.upload(self.local / name, name)
            self.sent[name] = now[name]

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.local, ignore_errors=True)


def problems(cfg: ShardforgeConfig) -> list[tuple[str, str]]:
    """(key, problem) for each setting a run with an s3:// output_dir does not support."""
    if not is_remote(cfg.output_dir):
        return []
    found = []
    for key, hint in UNSUPPORTED.items():
        if getattr(cfg, key):
            found.append((key, f"not supported with an s3:// output_dir; {hint}"))
    try:
        if not RemoteURI.parse(cfg.output_dir).key:
            found.append(("output_dir", "name a prefix inside the bucket (s3://BUCKET/PREFIX)"))
    except StorageError as exc:
        found.append(("output_dir", exc.message))
    return found
