"""Per-rank DTensor files' independent reader for `--verify`: ``torch.load(weights_only=True,
mmap=True)``, each full tensor assembled where torch's own placement code puts each rank's
local tensor: every placement's ``_split_tensor`` (what ``distribute_tensor`` shards with)
applied, left to right over the mesh, to a vector of each dimension's indices. Nothing of the
merge's own placement arithmetic (`formats.rankfiles.mesh`) is used."""

from __future__ import annotations

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
                covered[key] += _place(key, path, value, full, filled[key])
            del state
        for key, full in out.items():
            if covered[key] != full.numel():
                raise verify_failed(
                    key,
                    self.directory,
                    f"is covered by {covered[key]} of {full.numel()} elements for torch.load",
                )
        return out


def _place(
    key: str, path: Path, value: torch.Tensor, full: torch.Tensor, filled: set[tuple[int, ...]]
) -> int:
    """Copy `value` (a plain tensor, or a DTensor's local shard) into its place in `full`
    unless a copy of it was placed already; the number of elements placed."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(value, DTensor):  # a plain tensor: every rank has it all
        if filled:
            return 0
        full.copy_(value)
        filled.add(())
        return full.numel()
    mesh, coord = value.device_mesh, value.device_mesh.get_coordinate()
    if coord is None:
        raise verify_failed(key, path, "has no mesh position for torch.load")
    index = [torch.arange(n) for n in full.shape]
    sharding = []
    for mesh_dim, p in enumerate(value.placements):
        if not isinstance(p, (Shard, _StridedShard)):
            if p.is_replicate():
                continue
            raise verify_failed(key, path, f"has placement {p}, which is not read")
        d = p.dim
        parts, _ = p._split_tensor(
            index[d].view([1] * d + [-1]),
            mesh.size(mesh_dim),
            with_padding=False,
            contiguous=False,
        )
        index[d] = parts[coord[mesh_dim]].reshape(-1)
        sharding.append(coord[mesh_dim])
    local = value.to_local()
    if tuple(sharding) in filled or not local.numel():
        return 0  # a copy of a piece already placed, or an empty shard
    if full.dim():
        n = full.dim()
        full[tuple(ix.view([1] * d + [-1] + [1] * (n - d - 1)) for d, ix in enumerate(index))] = (
            local
        )
    else:
        full.copy_(local)
    filled.add(tuple(sharding))
    return local.numel()
