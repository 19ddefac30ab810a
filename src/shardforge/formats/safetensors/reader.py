"""A Hugging Face safetensors model directory (or one safetensors file) as named
`TensorSource`s, without loading a tensor.

    sources = open_safetensors_dir("base-model/")       # name -> SafetensorsSource
    sources = open_safetensors_file(adapter / "adapter_model.safetensors", adapter)

Each file's header is parsed here, not by the `safetensors` library (verification reads the
same files through the library, so the two never share a code path). The header is untrusted
input: its length is bounded (`MAX_HEADER_BYTES`, and within the file), it must be one JSON
object without duplicate names, every dtype comes from `DTYPES`, every shape is a list of
non-negative integers, and every tensor's ``[begin, end)`` lies inside the data section (and so
inside the file), is exactly ``numel * itemsize`` bytes long and overlaps no other tensor's.
An index (`model.safetensors.index.json`) may only name files inside the directory (symbolic
links resolved: `shardforge.io.files.open_regular`), and it must list exactly the tensors its
files hold. Every problem is a `CheckpointError` naming the file.

A tensor's bytes are one byte range of its file: `slabs` hands it to the writer for a
file-to-file copy when no cast is needed; `read` reads just that range.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import CheckpointError, printable, shown
from shardforge.formats.base import StoredTensor
from shardforge.formats.sources import WholeTensor
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.dtypes import SAFETENSORS_CODES, torch_dtype
from shardforge.io.files import open_regular, read_exact_into

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# the pickle-format weights a directory may hold instead (never read: they are pickles)
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# the longest JSON header (or index file) read
MAX_HEADER_BYTES = 100 << 20
# the 8-byte little-endian header length in front of the JSON
LENGTH_BYTES = 8
# dimensions of one tensor
MAX_DIMS = 64
METADATA_KEY = "__metadata__"
# the name of this format (`formats.safetensors.format.SafetensorsFormat.name`)
SAFETENSORS = "safetensors"

# safetensors dtype code -> torch dtype (the codes of `io.dtypes`' table, in the format's order)
DTYPES: dict[str, torch.dtype] = {
    code: torch_dtype(row.name) for code, row in SAFETENSORS_CODES.items()
}


@dataclass(frozen=True)
class SafetensorsSource(WholeTensor):
    """One tensor of a safetensors file: `nbytes` bytes at absolute byte `offset` of `path`."""

    path: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return [FileSlab(self.path, self.offset, self.nbytes, 0)] if self.nbytes else []

    def read(self, reader: ReadCache) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype)
        buf = bytearray(self.nbytes)
        read_exact_into(reader.fd(self.path), buf, self.offset, str(self.path))
        return torch.frombuffer(buf, dtype=self.dtype).view(self.shape)

    def stored(self) -> tuple[StoredTensor, ...]:
        """Named by its file (`StoredTensor.directory` is the safetensors file itself)."""
        return (StoredTensor(SAFETENSORS, self.path, self.key, self.dtype, self.shape),)

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]


def _bad(path: Path, problem: str) -> CheckpointError:
    what = "index" if path.name.endswith(".json") else "safetensors file"
    return CheckpointError(f"{path}: {problem}; the {what} is damaged or not one")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the name {shown(key)} appears twice")
        out[key] = value
    return out


def _parse_json(data: bytes, path: Path, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise _bad(path, f"its {what} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(path, f"its {what} is not valid JSON ({printable(str(exc))[:120]})") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(
    path: Path, name: str, info: Any, data_start: int, data_len: int
) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """dtype, shape and [begin, end) of one header entry, checked."""
    label = f"tensor {shown(name)}"
    if not isinstance(info, dict):
        raise _bad(path, f"{label}: the header entry is not an object")
    extra = sorted(set(info) - {"dtype", "shape", "data_offsets"})
    if extra:
        raise _bad(path, f"{label}: unknown header fields {shown(extra)}")
    dtype_name = info.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _bad(path, f"{label}: unknown dtype {shown(dtype_name)} (known: {', '.join(DTYPES)})")
    dtype = DTYPES[dtype_name]
    shape = info.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(_is_int(n) and n >= 0 for n in shape)
    ):
        raise _bad(path, f"{label}: shape {shown(shape)} is not a list of sizes")
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
    ):
        raise _bad(path, f"{label}: data_offsets {shown(offsets)} is not [begin, end]")
    begin, end = offsets
    if begin > end or end > data_len:
        raise _bad(
            path,
            f"{label}: bytes [{begin}, {end}) lie outside the data section of {data_len} bytes",
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise _bad(
            path,
            f"{label}: {dtype_name} {shape} takes {nbytes} bytes, the header gives it "
            f"{end - begin}",
        )
    return dtype, tuple(shape), data_start + begin, nbytes


def read_header(fd: int, size: int, path: Path) -> dict[str, SafetensorsSource]:
    """Every tensor of the safetensors file open as `fd` (`size` bytes), checked."""
    return read_header_and_metadata(fd, size, path)[0]


def read_header_and_metadata(
    fd: int, size: int, path: Path
) -> tuple[dict[str, SafetensorsSource], dict[str, str]]:
    """Every tensor of the safetensors file open as `fd` (`size` bytes), checked, and the
    header's `__metadata__` (strings by name; empty when there is none)."""
    if size < LENGTH_BYTES:
        raise _bad(path, f"it has {size} bytes, fewer than the {LENGTH_BYTES}-byte header length")
    head = bytearray(LENGTH_BYTES)
    read_exact_into(fd, head, 0, str(path))
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or length > size - LENGTH_BYTES:
        raise _bad(
            path,
            f"its header length {length} exceeds "
            + (
                f"the limit of {MAX_HEADER_BYTES} bytes"
                if length > MAX_HEADER_BYTES
                else f"the file's {size} bytes"
            ),
        )
    text = bytearray(length)
    read_exact_into(fd, text, LENGTH_BYTES, str(path))
    header = _parse_json(bytes(text), path, "header")
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    meta = header.get(METADATA_KEY)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _bad(path, f"its {METADATA_KEY} is not an object of strings")
    data_start = LENGTH_BYTES + length
    data_len = size - data_start
    out: dict[str, SafetensorsSource] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == METADATA_KEY:
            continue
        dtype, shape, offset, nbytes = _entry(path, name, info, data_start, data_len)
        out[name] = SafetensorsSource(path, name, dtype, shape, offset, nbytes)
        if nbytes:
            ranges.append((offset, offset + nbytes, name))
    ranges.sort()
    for (_, end_a, a), (begin_b, _, b) in itertools.pairwise(ranges):
        if begin_b < end_a:
            raise _bad(path, f"tensors {shown(a)} and {shown(b)} overlap")
    return out, dict(meta or {})


def open_safetensors_file(
    path: str | Path, root: str | Path | None = None
) -> dict[str, SafetensorsSource]:
    """name -> `SafetensorsSource` of one safetensors file (inside `root` when given)."""
    p = Path(path)
    fd = open_regular(p, root)
    try:
        return read_header(fd, os.fstat(fd).st_size, p)
    finally:
        os.close(fd)


def _read_index(path: Path, root: Path) -> dict[str, str]:
    fd = open_regular(path, root)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HEADER_BYTES:
            raise _bad(path, f"the index has {size} bytes, more than {MAX_HEADER_BYTES}")
        data = bytearray(size)
        read_exact_into(fd, data, 0, str(path))
    finally:
        os.close(fd)
    index = _parse_json(bytes(data), path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v for v in weight_map.values()
    ):
        raise _bad(path, "the index has no weight_map of tensor name -> file name")
    return weight_map


def open_safetensors_dir(directory: str | Path) -> dict[str, SafetensorsSource]:
    """name -> `SafetensorsSource` of a Hugging Face model directory: `model.safetensors`
    (what transformers loads first), else the files `model.safetensors.index.json` names."""
    root = Path(directory)
    single, index = root / SAFE_WEIGHTS_NAME, root / SAFE_WEIGHTS_INDEX_NAME
    if os.path.lexists(single):
        return open_safetensors_file(single, root)
    if not os.path.lexists(index):
        pickled = [n for n in PICKLE_WEIGHTS if (root / n).exists()]
        hint = (
            f"; it holds {pickled[0]}, a pickle shardforge does not load: convert it to "
            "safetensors (load it in a trusted environment and save_pretrained it with "
            "safe_serialization=True)"
            if pickled
            else ""
        )
        raise CheckpointError(
            f"{root}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}{hint}"
            if root.is_dir()
            else f"{root}: not a directory"
        )
    weight_map = _read_index(index, root)
    out: dict[str, SafetensorsSource] = {}
    for filename in sorted(set(weight_map.values())):
        path = root / filename
        tensors = open_safetensors_file(path, root)
        for name, source in tensors.items():
            if weight_map.get(name) != filename:
                raise _bad(index, f"{shown(name)} in {filename} is not listed for it in the index")
            out[name] = source
    missing = [n for n in weight_map if n not in out]
    if missing:
        raise _bad(
            index,
            f"{len(missing)} tensor(s) listed in the index are missing from their files "
            f"({shown(missing[:5])})",
        )
    return {n: out[n] for n in weight_map}


__all__ = [
    "DTYPES",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SafetensorsSource",
    "open_safetensors_dir",
    "open_safetensors_file",
    "read_header",
    "read_header_and_metadata",
]
