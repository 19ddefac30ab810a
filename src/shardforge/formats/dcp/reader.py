"""torch's DCP `FileSystemReader`, with what it would trust checked first.

torch's own reader uses plain `pickle.load` on `.metadata`, reads each record at the offset the
metadata names without checking it, and its default load planner reads non-tensor entries with
``torch.load(weights_only=False)``. Two readers replace it:

* `SafeFileSystemReader` reads `.metadata` through the allow-list unpickler
  (`formats.dcp.pickles`: plain records first, torch's dataclasses then built from checked
  fields) and leaves the tensor bytes to torch (``torch.load(weights_only=True)``). `--verify`
  uses it: the checkpoint is then read by other code than the merge's record parser.
* `CheckedFileSystemReader` (resume in `train`, `--engine transformers`) reads every record
  through the merge's one record parser: the file opened as a regular file inside the
  checkpoint, the zip record located inside its byte range, the tensor view checked against
  its storage and its `.metadata` entry, every member checked against its CRC-32, and
  non-tensor entries read through the allow-list as plain values. It needs
  `CheckedLoadPlanner`, which takes those values instead of unpickling bytes itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import METADATA_FILE, Chunk
from shardforge.formats.dcp.pickles import load_metadata_pickle
from shardforge.formats.dcp.records import (
    check_record,
    check_record_crcs,
    parse_record,
    read_chunk,
    read_value,
)
from shardforge.io.files import open_regular
from shardforge.io.unpickler import sanitize


def read_dcp_metadata(directory: str | Path) -> Metadata:
    """The `Metadata` (torch's classes) of a DCP directory, through the allow-list."""
    path = Path(directory) / METADATA_FILE
    metadata = load_metadata_pickle(path, as_torch=True)
    if not isinstance(metadata, Metadata):  # internal: to_torch_metadata builds one or refuses
        raise CheckpointError(f"{path}: holds {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(str(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        self.checked_metadata = metadata
        return metadata


class CheckedLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, handed non-tensor values already read through the
    allow-list (`load_value`) instead of unpickling their bytes with ``weights_only=False``."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise AssertionError("CheckedFileSystemReader hands values to load_value, never bytes")

    def load_value(self, read_item: ReadItem, value: object) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value


class CheckedFileSystemReader(SafeFileSystemReader):
    """Reads every record through shardforge's record parser (see the module docstring)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert isinstance(planner, CheckedLoadPlanner), "pass planner=CheckedLoadPlanner()"
        root = Path(self.path)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative, items in per_file.items():
            file = root / relative
            with _opened(file, root) as fd:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if info.transform_descriptors:
                        raise CheckpointError(
                            f"{file}: the record at byte {info.offset} is stored with transforms "
                            f"{sanitize(info.transform_descriptors)}; not supported"
                        )
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_value(item, read_value(file, fd, info.offset, info.length))
                        continue
                    chunk = self._chunk(item, file, info.offset, info.length)
                    parsed = parse_record(file, fd, info.offset, info.length)
                    raw = check_record(chunk, parsed)
                    check_record_crcs(fd, parsed.record, str(file))
                    tensor = read_chunk(chunk, fd, raw)
                    for dim, (start, length) in enumerate(
                        zip(item.storage_offsets, item.lengths, strict=True)
                    ):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise CheckpointError(
                            f"{file}: the record at byte {info.offset} gives shape "
                            f"{list(tensor.size())}, the state dict expects {list(target.size())}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _chunk(self, item: ReadItem, file: Path, offset: int, length: int) -> Chunk:
        """The `.metadata` chunk a read item's record holds (its global offsets and shape)."""
        index = item.storage_index
        entry = self.checked_metadata.state_dict_metadata.get(index.fqn)
        wanted = tuple(index.offset or ())
        if isinstance(entry, TensorStorageMetadata):
            for c in entry.chunks:
                if tuple(c.offsets) == wanted:
                    return Chunk(tuple(c.offsets), tuple(c.sizes), file, offset, length)
        raise CheckpointError(
            f"{file}: .metadata has no chunk of {sanitize(index.fqn)!r} at {list(wanted)[:8]}; "
            "the checkpoint is damaged"
        )


@contextmanager
def _opened(file: Path, root: Path) -> Iterator[int]:
    fd = open_regular(file, root)
    try:
        yield fd
    finally:
        os.close(fd)


def load_checked(state_dict: dict[str, Any], directory: Path, no_dist: bool = False) -> None:
    """`dcp.load` of `directory` into `state_dict` through `CheckedFileSystemReader`.

    Any failure is one CheckpointError, the same on every rank (DCP gathers the ranks'
    exceptions): a rank's own CheckpointError as it was raised, anything else summed up in
    one line.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.load(
            state_dict,
            storage_reader=CheckedFileSystemReader(str(directory)),
            planner=CheckedLoadPlanner(),
            no_dist=no_dist,
        )
    except CheckpointError:
        raise
    except CheckpointException as exc:
        failures = [f[0] for _, f in sorted(exc.failures.items())]
        ours = [f for f in failures if isinstance(f, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise _unreadable(directory, failures[0] if failures else exc) from None
    except Exception as exc:
        raise _unreadable(directory, exc) from None


def _unreadable(directory: Path, exc: BaseException) -> CheckpointError:
    lines = str(exc).strip().splitlines()
    reason = sanitize(lines[-1], 200) if lines else ""
    return CheckpointError(
        f"{directory}: cannot be loaded ({type(exc).__name__}{': ' + reason if reason else ''})"
    )
