"""DCP safetensors shards' independent reader for `--verify`: the `safetensors` library
(``safe_open``: its own header parser, its ``metadata()`` for ``DCP_SHARDING_INFO``), each
full tensor assembled where the library says each chunk goes; never shardforge's parser. (The
consolidated files are read by `formats.safetensors.reference`.)"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import MergeError
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.dcp_safetensors.names import list_shards
from shardforge.formats.dcp_safetensors.sharded import SAVED_OFFSETS, SHARDING_INFO
from shardforge.formats.reference import safetensors_file, short_reason, verify_failed


@dataclass
class ShardsReference(ReferenceReader):
    """The shard files of one folder, read by the `safetensors` library (no checksums)."""

    directory: Path

    def check_crcs(self, keys: set[str]) -> None:
        return None

    def load(self, wanted: Sequence[StoredTensor]) -> dict[str, torch.Tensor]:
        out = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in wanted}
        covered = dict.fromkeys(out, 0)
        for path in list_shards(self.directory):
            try:
                self._place(path, out, covered)
            except MergeError:
                raise
            except Exception as exc:
                raise MergeError(
                    f"verification failed: the safetensors library cannot read {path} "
                    f"({short_reason(exc)})"
                ) from None
        for key, full in out.items():
            if covered[key] != full.numel():
                raise verify_failed(
                    key,
                    self.directory,
                    f"is covered by {covered[key]} of {full.numel()} "
                    "elements for the safetensors library",
                )
        return out

    def _place(self, path: Path, out: dict[str, torch.Tensor], covered: dict[str, int]) -> None:
        from safetensors import safe_open

        with safetensors_file(path, out) as local, safe_open(str(local), framework="pt") as f:
            present = set(f.keys()) & set(out)
            if not present:
                return
            info = json.loads((f.metadata() or {})[SHARDING_INFO])
            for key in sorted(present):
                part, full = f.get_tensor(key), out[key]
                if part.dtype != full.dtype or part.dim() != full.dim():
                    raise verify_failed(
                        key,
                        path,
                        f"is {part.dtype} {list(part.shape)} for the safetensors "
                        f"library but {full.dtype} {list(full.shape)} for the merge",
                    )
                region = full
                for dim, start in enumerate(info[key][SAVED_OFFSETS]):
                    region = region.narrow(dim, start, part.shape[dim])
                region.copy_(part)
                covered[key] += math.prod(part.shape)
