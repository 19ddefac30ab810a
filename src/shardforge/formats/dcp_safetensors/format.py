"""The dcp-safetensors row of the format registry: DCP's safetensors storage
(``HuggingFaceStorageWriter(save_distributed=True)``), in two forms:

* sharded: a folder of ``shard-<S>-model-<K>-of-<N>.safetensors`` files, one set per rank,
  read chunk by chunk (`sharded`);
* consolidated (``enable_consolidation=True``, torchtitan's ``last_save_in_hf``): the shard
  files in ``sharded/``, torch's consolidated ``model-<K>-of-<N>.safetensors`` and
  ``model.safetensors.index.json`` beside it. The consolidated files are read (whole tensors),
  after their names, dtypes and shapes are checked against the shards' headers; while they are
  missing (torch's consolidator stops on integer and bool tensors) the shards are read.

A Hugging Face directory without ``sharded/`` is the safetensors row's (a base model, an
output), never this one.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath

from shardforge.errors import CheckpointError
from shardforge.formats.base import (
    CheckpointFormat,
    Contents,
    NamedSource,
    ReferenceReader,
)
from shardforge.formats.dcp_safetensors.names import (
    DCP_SAFETENSORS,
    INDEX,
    SHARD_SHOWN,
    SHARDED_DIR,
    list_shards,
    shards_dir,
    world_size,
)


def _consolidated(folder: Path) -> bool:
    return shards_dir(folder) != folder and os.path.lexists(folder / INDEX)


def _required(folder: Path) -> Path:
    found = shards_dir(folder)
    if found is None:
        raise CheckpointError(f"{folder}: no {SHARD_SHOWN} files in it or in {SHARDED_DIR}/")
    return found


class DcpSafetensorsFormat(CheckpointFormat):
    name = DCP_SAFETENSORS
    looked_for = (
        f"a folder of {SHARD_SHOWN} files (DCP HuggingFaceStorageWriter), or torch's "
        f"consolidated model files with them in {SHARDED_DIR}/"
    )
    shards_described = f"the {SHARD_SHOWN} files (and the consolidated files beside them)"

    def detect(self, folder: Path) -> bool:
        return shards_dir(folder) is not None

    def open(self, folder: Path) -> dict[str, NamedSource]:
        from shardforge.formats.dcp_safetensors.sharded import ShardedSource, plan_shards

        shards = _required(folder)
        plan = plan_shards(shards)
        if _consolidated(folder):
            from shardforge.formats.dcp_safetensors.consolidated import open_consolidated

            whole = open_consolidated(folder / INDEX, plan)
            return {k: NamedSource((k,), s) for k, s in whole.items()}
        return {k: NamedSource((k,), ShardedSource(t, shards)) for k, t in plan.items()}

    def describe(self, folder: Path) -> Contents:
        from shardforge.formats.dcp_safetensors.sharded import plan_shards

        shards = _required(folder)
        return Contents.of_rank_files(
            self.name, plan_shards(shards), world_size(shards), SHARD_SHOWN
        )

    def shard_files(self, folder: Path) -> list[PurePath]:
        """The shard files, and where consolidated, the consolidated files and the index."""
        shards = _required(folder)
        out = [PurePath(p.relative_to(folder)) for p in list_shards(shards)]
        if _consolidated(folder):
            from shardforge.formats.safetensors.reader import open_safetensors_dir

            files = sorted({s.path for s in open_safetensors_dir(folder).values()})
            out = [PurePath(INDEX), *(PurePath(p.relative_to(folder)) for p in files), *out]
        return out

    def reference(self, location: Path) -> ReferenceReader:
        """The `safetensors` library: on one consolidated file (`location` is the file), or on
        every shard file of the folder `location`."""
        from shardforge.formats.dcp_safetensors.reference import ShardsReference
        from shardforge.formats.safetensors.reference import SafetensorsReference

        if location.is_file():
            return SafetensorsReference(location)
        return ShardsReference(location)
