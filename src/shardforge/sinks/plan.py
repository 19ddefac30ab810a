"""Plan the output safetensors files from names, shapes and dtypes alone.

Shard assignment follows `save_pretrained` (huggingface_hub's greedy split in state-dict order,
decimal units); inside a file, tensors are laid out as the safetensors library lays them out
(by dtype, then name), so the bytes match what `save_pretrained` would write.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardforge.io.dtypes import SAFETENSORS_ORDER, safetensors_code

if TYPE_CHECKING:
    import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
FILENAME_PATTERN = "model{suffix}.safetensors"
FILE_METADATA = {"format": "pt"}


def default_max_shard_size() -> str:
    """The default of the installed transformers' `save_pretrained`."""
    import inspect

    from transformers import PreTrainedModel

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"]
    return str(default.default)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype  # a `DtypeName` in the head start's guess (merge.overlap)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class PlannedTensor:
    spec: TensorSpec
    offset: int  # absolute offset of the first byte in the file


@dataclass
class PlannedFile:
    name: str
    header: bytes  # 8-byte length + JSON header (padded)
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.spec.nbytes for t in self.tensors)


@dataclass(frozen=True)
class OutputPlan:
    files: list[PlannedFile]
    index: dict[str, Any] | None  # model.safetensors.index.json content when sharded

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def tensors(self) -> list[tuple[PlannedFile, PlannedTensor]]:
        return [(f, t) for f in self.files for t in f.tensors]


def _layout_file(name: str, specs: list[TensorSpec]) -> PlannedFile:
    order = sorted(
        specs, key=lambda s: (-SAFETENSORS_ORDER.index(safetensors_code(s.dtype)), s.name)
    )
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for s in order:
        offsets[s.name] = (pos, pos + s.nbytes)
        pos += s.nbytes
    header: dict[str, Any] = {"__metadata__": FILE_METADATA}
    for s in order:  # the header lists tensors in data order, as safetensors writes it
        header[s.name] = {
            "dtype": safetensors_code(s.dtype),
            "shape": list(s.shape),
            "data_offsets": list(offsets[s.name]),
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    head = struct.pack("<Q", len(text)) + text
    f = PlannedFile(name, head)
    f.tensors = [PlannedTensor(s, len(head) + offsets[s.name][0]) for s in order]
    return f


def save_order(names: list[str]) -> list[str]:
    """The order save_pretrained shards a loaded model's tensors in: transformers 5.x sorts
    them by dotted natural key (layer numbers numerically); 4.x keeps state-dict order."""
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:
        return list(names)
    return sorted(names, key=dot_natural_key)


def layout_files(
    ordered: dict[str, TensorSpec], max_shard_size: int | str | None
) -> tuple[list[PlannedFile], Any]:
    """The files holding `ordered` (name -> spec, in save order), split as `save_pretrained`
    splits them (huggingface_hub's greedy split; None: one file), with the split (None when
    unsplit)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    if max_shard_size is None:
        return [_layout_file(SAFE_WEIGHTS_NAME, list(ordered.values()))], None
    split = split_state_dict_into_shards_factory(
        ordered,
        get_storage_size=lambda s: s.nbytes,
        filename_pattern=FILENAME_PATTERN,
        max_shard_size=max_shard_size,
    )
    files = [
        _layout_file(fname, [ordered[n] for n in names])
        for fname, names in split.filename_to_tensors.items()
    ]
    return files, split


def plan_output(
    specs: list[TensorSpec], max_shard_size: int | str | None, total_parameters: int
) -> OutputPlan:
    """Assign every tensor its file and byte range, in `save_order`; `max_shard_size` None
    plans one file whatever its size (the single-file formats)."""
    unknown = sorted({str(s.dtype) for s in specs if safetensors_code(s.dtype) is None})
    if unknown:
        from shardforge.errors import MergeError

        raise MergeError(f"dtypes {unknown} cannot be stored in safetensors")
    by_name = {s.name: s for s in specs}
    ordered = {n: by_name[n] for n in save_order(list(by_name))}
    try:
        files, split = layout_files(ordered, max_shard_size)
    except ValueError as exc:  # huggingface_hub's words for a size it cannot parse
        from shardforge.errors import MergeError

        if isinstance(exc, MergeError):
            raise
        raise MergeError(f"--max_shard_size {max_shard_size!r}: {exc}") from None
    index = None
    if split is not None and split.is_sharded:
        index = {
            "metadata": {"total_parameters": total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
    return OutputPlan(files, index)
