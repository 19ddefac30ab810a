"""Write a single-file torch checkpoint ``{"state_dict": {name: tensor}}`` one tensor at a time.

The file is what ``torch.save`` writes (a zip through torch's own `PyTorchFileWriter`:
``data.pkl``, ``byteorder``, one ``data/<n>`` record per tensor, aligned): the pickle is built
first from names, dtypes and shapes alone with the standard `pickle` module, then each tensor is
read from its source, cast, and written as its record. Memory: about one tensor. Every tensor is
a CPU tensor with its own storage; `torch.load(path, weights_only=True)` (or ``mmap=True``)
loads it.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardforge.checkpoint.plan import TensorSpec
from shardforge.checkpoint.sources import TensorSource
from shardforge.checkpoint.stream import ChunkReader
from shardforge.errors import MergeError

STATE_DICT_KEY = "state_dict"
PICKLE_PROTOCOL = 2  # torch.save's default
VERIFY_BLOCK = 16 << 20  # bytes compared at a time

# dtype -> the typed storage class torch.save names in the pickle
STORAGE_TYPES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}


class _StorageRef:
    """Stands for storage `key` in the pickle (written as a persistent id, as torch.save does)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles as torch.save pickles a contiguous CPU tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> tuple[Any, ...]:
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        args = (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False)
        return (torch._utils._rebuild_tensor_v2, (*args, OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, STORAGE_TYPES[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


def state_dict_pickle(specs: Sequence[TensorSpec]) -> bytes:
    """`data.pkl` of ``{"state_dict": {name: tensor}}``; storage keys "0", "1", ... in order."""
    unknown = sorted({str(s.dtype) for s in specs if s.dtype not in STORAGE_TYPES})
    if unknown:
        raise MergeError(f"dtypes {unknown} cannot be written in the torch format")
    tensors = {
        s.name: _TensorRef(_StorageRef(str(i), s.dtype, math.prod(s.shape)), s.shape)
        for i, s in enumerate(specs)
    }
    buf = io.BytesIO()
    _Pickler(buf, protocol=PICKLE_PROTOCOL).dump({STATE_DICT_KEY: tensors})
    return buf.getvalue()


def write_torch_file(
    specs: Sequence[TensorSpec],
    sources: Mapping[str, TensorSource],
    path: Path,
    progress: Callable[[int], None],
) -> None:
    """Write `path` as torch.save would write ``{"state_dict": ...}``, one tensor at a time."""
    from torch.serialization import _open_zipfile_writer

    data = state_dict_pickle(specs)
    with ChunkReader() as reader, _open_zipfile_writer(str(path)) as writer:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for i, spec in enumerate(specs):
            tensor = sources[spec.name].read(reader).to(spec.dtype).contiguous()
            storage = tensor.untyped_storage()
            if tensor.storage_offset() or storage.nbytes() != spec.nbytes:
                tensor = tensor.clone()
                storage = tensor.untyped_storage()
            writer.write_record(f"data/{i}", storage, spec.nbytes)
            progress(spec.nbytes)
            del tensor, storage
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_torch_file(
    specs: Sequence[TensorSpec], sources: Mapping[str, TensorSource], path: Path
) -> int:
    """Check `path` as a loader sees it and compare every tensor, bit for bit, with its source;
    return the number compared.

    Structure (names, dtypes, shapes) through ``torch.load(weights_only=True, mmap=True)``
    without touching the data; each tensor's bytes then through torch's zip reader and `pread`,
    one tensor at a time (memory: about one tensor plus a block).
    """
    loaded = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    state = loaded.get(STATE_DICT_KEY) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or list(state) != [s.name for s in specs]:
        raise MergeError(f"verification failed: {path} does not hold the planned state_dict")
    for spec in specs:
        got = state[spec.name]
        if got.dtype != spec.dtype or tuple(got.shape) != spec.shape:
            _differs(spec.name, path)
    del loaded, state
    archive = torch._C.PyTorchFileReader(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        with ChunkReader() as reader:
            for i, spec in enumerate(specs):
                _compare(archive, fd, i, spec, sources[spec.name].read(reader), path)
    finally:
        os.close(fd)
    return len(specs)


def _compare(
    archive: Any, fd: int, i: int, spec: TensorSpec, expected: torch.Tensor, path: Path
) -> None:
    record = f"data/{i}"
    if not archive.has_record(record) or archive.get_record_size(record) != spec.nbytes:
        _differs(spec.name, path)
    want = _bits(expected.to(spec.dtype))
    start = archive.get_record_offset(record)
    for pos in range(0, spec.nbytes, VERIFY_BLOCK):
        data = os.pread(fd, min(VERIFY_BLOCK, spec.nbytes - pos), start + pos)
        got = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if not torch.equal(got, want[pos : pos + len(data)]):
            _differs(spec.name, path)


def _differs(name: str, path: Path) -> None:
    raise MergeError(
        f"verification failed: {name} in {path} differs from the checkpoint; the output is not "
        "trustworthy"
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
