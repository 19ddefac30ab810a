"""torch's consolidated files of DCP's safetensors storage (``model-<K>-of-<N>.safetensors``
and ``model.safetensors.index.json``, written from the shards in ``sharded/``), read as plain
safetensors (`formats.safetensors.reader`) once they are known to hold exactly the tensors the
shards hold: the same names, dtypes and shapes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardforge.errors import CheckpointError, shown
from shardforge.formats.base import StoredTensor
from shardforge.formats.dcp_safetensors.names import DCP_SAFETENSORS
from shardforge.formats.dcp_safetensors.sharded import ShardedTensor
from shardforge.formats.safetensors.reader import SafetensorsSource, open_safetensors_dir


@dataclass(frozen=True)
class ConsolidatedSource(SafetensorsSource):
    """A tensor of a consolidated file, verified by this row's reference reader."""

    def stored(self) -> tuple[StoredTensor, ...]:
        return (StoredTensor(DCP_SAFETENSORS, self.path, self.key, self.dtype, self.shape),)


def open_consolidated(
    index: Path, shards: dict[str, ShardedTensor]
) -> dict[str, ConsolidatedSource]:
    """name -> tensor of the consolidated files `index` names, each checked against the
    shards' tensor of that name."""
    whole = open_safetensors_dir(index.parent)
    for name in sorted(set(whole) ^ set(shards)):
        where = "shards" if name in shards else "consolidated files"
        raise CheckpointError(
            f"{index}: tensor {shown(name)} is only in the {where}; the consolidated files are "
            "incomplete or from another save (remove them and their index to merge the shards)"
        )
    out = {}
    for name, t in shards.items():
        s = whole[name]
        if (s.dtype, s.shape) != (t.dtype, t.shape):
            raise CheckpointError(
                f"{s.path}: tensor {shown(name)} is {s.dtype} {list(s.shape)}, the shards hold "
                f"{t.dtype} {list(t.shape)}; the consolidated files are from another save"
            )
        out[name] = ConsolidatedSource(s.path, s.key, s.dtype, s.shape, s.offset, s.nbytes)
    return out
