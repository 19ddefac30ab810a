"""Fill planned safetensors files (and the index) from the sources, one tensor at a time (what
every safetensors sink writes with).

A source whose bytes are slabs of input files (no cast) is copied file to file by a few threads
(`copy_file_range`, no bytes through Python); every other source writes itself into its planned
byte range (`TensorSource.write`: a DCP entry chunk by chunk). Peak memory is therefore
about one tensor, whatever the model size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from shardforge.formats.base import Destination, TensorSource
from shardforge.io.copy import CopyJob, FileSlab, ReadCache, copy_jobs, copy_range, pwrite_all
from shardforge.io.fs import preallocate
from shardforge.sinks.plan import SAFE_WEIGHTS_INDEX_NAME, OutputPlan

if TYPE_CHECKING:
    import torch

    from shardforge.sinks.resume import LocalJournal

Progress = Callable[[int], None]


def write_plan(
    plan: OutputPlan,
    sources: Mapping[str, TensorSource],
    directory: Path,
    progress: Progress,
    journal: LocalJournal | None = None,
) -> None:
    """Create every planned file (and the index when sharded) in `directory`; fsync them.
    With a `journal`, a file an interrupted merge finished is kept (`sinks.resume`) and each
    file written is recorded."""
    with ReadCache() as reader:
        for pf in plan.files:
            if journal is not None and journal.kept(pf):
                progress(pf.size)
                continue
            fd = os.open(directory / pf.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                preallocate(fd, pf.size)
                pwrite_all(fd, memoryview(pf.header), 0)
                progress(len(pf.header))
                jobs: list[CopyJob] = []
                through_memory = []
                for planned in pf.tensors:
                    src = sources[planned.spec.name]
                    same = src.dtype == planned.spec.dtype
                    slabs = src.slabs(reader) if same else None
                    if slabs is None:
                        through_memory.append((planned, src))
                        continue
                    jobs += [
                        CopyJob(s.path, s.src_offset, fd, planned.offset + s.dst_offset, s.nbytes)
                        for s in slabs
                    ]
                copy_jobs(jobs, copy_range, progress)
                for planned, src in through_memory:
                    src.write(reader, Destination(fd, planned.offset, planned.spec.dtype, progress))
                os.fsync(fd)
            finally:
                os.close(fd)
            if journal is not None:
                journal.finish(pf)
    write_index(plan, directory)


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
) -> None:
    """Write every tensor the early copy did not into the existing planned files; fsync them
    (the index is the caller's, as with `write_plan`)."""
    progress(sum(len(f.header) for f in plan.files))
    with ReadCache() as reader:
        for pf in plan.files:
            fd = os.open(directory / pf.name, os.O_WRONLY)
            try:
                jobs: list[CopyJob] = []
                rest: list[tuple[int, TensorSource, torch.dtype]] = []
                for planned in pf.tensors:
                    name = planned.spec.name
                    if name in copied:
                        progress(planned.spec.nbytes)
                        continue
                    src = sources[name]
                    slabs = src.slabs(reader) if src.dtype == planned.spec.dtype else None
                    if slabs is None:
                        rest.append((planned.offset, src, planned.spec.dtype))
                        continue
                    jobs += [
                        CopyJob(s.path, s.src_offset, fd, planned.offset + s.dst_offset, s.nbytes)
                        for s in slabs
                    ]
                copy_jobs(jobs, copy_range, progress)
                for offset, src, dtype in rest:
                    src.write(reader, Destination(fd, offset, dtype, progress))
                os.fsync(fd)
            finally:
                os.close(fd)
            if journal is not None:
                journal.finish(pf)
