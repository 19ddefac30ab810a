"""The safetensors row of the format registry: a Hugging Face model directory
(`model.safetensors`, or the files `model.safetensors.index.json` names), as a base model or an
adapter is stored. It is never a sharded checkpoint to merge (`sharded = False`): layouts do not
look for it, the merge reads it for LoRA bases and adapters, `inspect` can describe it."""

from __future__ import annotations

from pathlib import Path, PurePath

from shardforge.formats.base import (
    CheckpointFormat,
    Contents,
    NamedSource,
    ReferenceReader,
    TensorFact,
)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class SafetensorsFormat(CheckpointFormat):
    name = "safetensors"
    looked_for = "a Hugging Face directory with model.safetensors (or its index)"
    shards_described = "the .safetensors files"
    sharded = False

    def detect(self, folder: Path) -> bool:
        return (folder / SAFE_WEIGHTS_NAME).is_file() or (
            folder / SAFE_WEIGHTS_INDEX_NAME
        ).is_file()

    def open(self, folder: Path) -> dict[str, NamedSource]:
        from shardforge.formats.safetensors.reader import open_safetensors_dir

        return {k: NamedSource((k,), s) for k, s in open_safetensors_dir(folder).items()}

    def describe(self, folder: Path) -> Contents:
        tensors = tuple(TensorFact.of(k, n) for k, n in self.open(folder).items())
        return Contents(
            storage=self.name,
            tensors=tensors,
            non_tensor_keys=(),
            world_size=None,
            world_size_source=None,
        )

    def shard_files(self, folder: Path) -> list[PurePath]:
        from shardforge.formats.safetensors.reader import open_safetensors_dir

        files = {s.path for s in open_safetensors_dir(folder).values()}
        index = (
            [PurePath(SAFE_WEIGHTS_INDEX_NAME)]
            if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file()
            else []
        )
        return [*index, *sorted(PurePath(p.relative_to(folder)) for p in files)]

    def reference(self, location: Path) -> ReferenceReader:
        from shardforge.formats.safetensors.reference import SafetensorsReference

        return SafetensorsReference(location)
