"""Fill planned safetensors files (and the index) from the sources, one tensor at a time (what
every safetensors sink writes with).

A source whose bytes are slabs of input files (no cast) is copied file to file by a few threads
(no tensor in between); every other source writes itself into its planned byte range
(`TensorSource.write`: a DCP entry chunk by chunk). Peak memory is therefore about one
tensor, whatever the model size. Every file is written through `io.direct.writes_to`: its
bytes gathered in aligned windows, written with O_DIRECT (around the page cache).

With `hashes` (a directory's integrity manifest, `sinks.manifest`) every file's hash is taken
from its written bytes (`io.digest.FileHash`: from the windows, in the file's order, or read
back where a window went through the page cache): the tensors are then written in file order,
runs of slab tensors copied in the order of their output bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from shardforge.formats.base import Destination, TensorSource
from shardforge.io.copy import CopyJob, FileSlab, ReadCache, copy_jobs, copy_range, pwrite_all
from shardforge.io.digest import Digests, FileHash
from shardforge.io.direct import writes_to
from shardforge.io.fs import preallocate
from shardforge.sinks.plan import SAFE_WEIGHTS_INDEX_NAME, OutputPlan, PlannedFile

if TYPE_CHECKING:
    import torch

    from shardforge.sinks.resume import LocalJournal

Progress = Callable[[int], None]
# file name -> the hash of its bytes as they were written (`sinks.manifest`), or the digest
# of a file an interrupted merge wrote and this one kept (`sinks.resume`)
Hashes = Digests


def write_plan(
    plan: OutputPlan,
    sources: Mapping[str, TensorSource],
    directory: Path,
    progress: Progress,
    journal: LocalJournal | None = None,
    hashes: Hashes | None = None,
) -> None:
    """Create every planned file (and the index when sharded) in `directory`; fsync them.
    With a `journal`, a file an interrupted merge finished is kept (`sinks.resume`) and each
    file written is recorded. With `hashes`, each file's hash as it was written (or, for a
    kept file, its digest as the journal recorded it) is added to it."""
    with ReadCache() as reader:
        for pf in plan.files:
            if journal is not None and journal.kept(pf):
                progress(pf.size)
                if hashes is not None:
                    hashes[pf.name] = journal.digest(pf.name, hashes.algo)
                continue
            fd = os.open(directory / pf.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                preallocate(fd, pf.size)
                h = None if hashes is None else hashes.start(pf.name, directory / pf.name)
                with writes_to(fd, pf.size, h):
                    pwrite_all(fd, memoryview(pf.header), 0)
                    progress(len(pf.header))
                    _fill(pf, sources, reader, fd, progress, set(), ordered=h is not None)
                os.fsync(fd)
            finally:
                os.close(fd)
            _finished(pf, journal, h)
    write_index(plan, directory)


def _finished(pf: PlannedFile, journal: LocalJournal | None, h: FileHash | str | None) -> None:
    """`pf` is written and fsynced: the journal records it, with the digest of its written
    bytes when it was hashed (taken on the journal's thread; else the journal hashes it)."""
    if journal is not None:
        journal.finish(pf, h if isinstance(h, FileHash) else None)


def _fill(
    pf: PlannedFile,
    sources: Mapping[str, TensorSource],
    reader: ReadCache,
    fd: int,
    progress: Progress,
    skip: set[str],
    ordered: bool,
) -> None:
    """Write every tensor of `pf` but those in `skip`: slabs copied file to file, the rest
    through memory. `ordered`: in file order (a hashed file), runs of slab tensors copied
    together; else all slabs first, in the order of their source bytes."""
    jobs: list[CopyJob] = []
    rest: list[tuple[int, TensorSource, torch.dtype]] = []
    for planned in pf.tensors:
        name = planned.spec.name
        if name in skip:
            continue
        src = sources[name]
        slabs = src.slabs(reader) if src.dtype == planned.spec.dtype else None
        if slabs is None:
            if ordered:  # the run of slabs before this tensor, then the tensor
                copy_jobs(jobs, copy_range, progress)
                jobs = []
                src.write(reader, Destination(fd, planned.offset, planned.spec.dtype, progress))
            else:
                rest.append((planned.offset, src, planned.spec.dtype))
            continue
        jobs += [
            CopyJob(s.path, s.src_offset, fd, planned.offset + s.dst_offset, s.nbytes)
            for s in slabs
        ]
    copy_jobs(jobs, copy_range, progress)
    for offset, src, dtype in rest:
        src.write(reader, Destination(fd, offset, dtype, progress))


def write_index(plan: OutputPlan, directory: Path) -> None:
    """model.safetensors.index.json when the weights are sharded."""
    if plan.index is not None:
        text = json.dumps(plan.index, indent=2, sort_keys=True) + "\n"
        (directory / SAFE_WEIGHTS_INDEX_NAME).write_text(text, encoding="utf-8")


def finish_plan(
    plan: OutputPlan,
    sources: Mapping[str, TensorSource],
    directory: Path,
    copied: Mapping[str, list[FileSlab]],
    progress: Progress,
    journal: LocalJournal | None = None,
    hashes: Hashes | None = None,
) -> None:
    """Write every tensor the early copy did not into the existing planned files; fsync them
    (the index is the caller's, as with `write_plan`). `hashes`: the early copy's hashes of
    these files, which this writing completes."""
    progress(sum(len(f.header) for f in plan.files))
    with ReadCache() as reader:
        for pf in plan.files:
            fd = os.open(directory / pf.name, os.O_WRONLY)
            try:
                done = {t.spec.name for t in pf.tensors if t.spec.name in copied}
                progress(sum(t.spec.nbytes for t in pf.tensors if t.spec.name in done))
                h = None if hashes is None else hashes[pf.name]
                assert not isinstance(h, str)  # (the early copy's hash of it so far)
                with writes_to(fd, pf.size, h):
                    _fill(pf, sources, reader, fd, progress, done, ordered=h is not None)
                os.fsync(fd)
            finally:
                os.close(fd)
            _finished(pf, journal, h)
