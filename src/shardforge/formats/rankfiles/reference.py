"""Per-rank DTensor files' independent reader for `--verify`: ``torch.load(weights_only=True,
mmap=True)``, each full tensor assembled where torch's own placement arithmetic puts each
rank's local tensor (``DTensor.__create_chunk_list__``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import MergeError
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.rankfiles.names import RANK_NAMES, RankNames
from shardforge.formats.reference import check_zip_crcs, torch_load, verify_failed


@dataclass
class RankFilesReference(ReferenceReader):
    """One folder of per-rank DTensor files read by ``torch.load(weights_only=True,
    mmap=True)``: each file is mapped (not read) per batch, and only the wanted keys' local
    tensors are copied out."""

    directory: Path
    names: RankNames = RANK_NAMES
    crc_checked: bool = False
    files: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        from shardforge.formats.rankfiles.rank_plan import list_rank_files

        self.files = list(list_rank_files(self.directory, self.names).values())

    def check_crcs(self, keys: set[str]) -> None:
        if self.crc_checked:
            return
        for path in self.files:
            check_zip_crcs(path, self.directory, [(0, path.stat().st_size)])
        self.crc_checked = True

    def _open(self, path: Path) -> dict[str, Any]:
        loaded = torch_load(path)
        if not isinstance(loaded, dict):
            raise MergeError(f"verification failed: {path} does not hold a state dict")
        return loaded

    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in wanted}
        filled: dict[str, set[tuple[int, ...]]] = {s.key: set() for s in wanted}
        covered = dict.fromkeys(out, 0)
        for path in self.files:
            state = self._open(path)
            for key, full in out.items():
                value = state.get(key)
                if not isinstance(value, torch.Tensor):
                    raise verify_failed(key, path, "is missing from this rank file (torch.load)")
                if tuple(value.shape) != tuple(full.shape) or value.dtype != full.dtype:
                    raise verify_failed(
                        key,
                        path,
                        f"is {value.dtype} {list(value.shape)} for torch.load but "
                        f"{full.dtype} {list(full.shape)} for the merge",
                    )
                if not isinstance(value, DTensor):  # a plain tensor: every rank has it all
                    if not filled[key]:
                        full.copy_(value)
                        filled[key].add(())
                        covered[key] = full.numel()
                    continue
                for chunk in value.__create_chunk_list__():
                    offsets = tuple(int(o) for o in chunk.offsets)
                    sizes = tuple(int(n) for n in chunk.sizes)
                    if offsets in filled[key] or not math.prod(sizes):
                        continue  # a replica of a box already read, or an empty shard
                    region = full
                    for dim, (start, size) in enumerate(zip(offsets, sizes, strict=True)):
                        region = region.narrow(dim, start, size)
                    region.copy_(value.to_local())
                    filled[key].add(offsets)
                    covered[key] += math.prod(sizes)
            del state
        for key, full in out.items():
            if covered[key] != full.numel():
                raise verify_failed(
                    key,
                    self.directory,
                    f"is covered by {covered[key]} of {full.numel()} elements for torch.load",
                )
        return out
