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
import logging
import math
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from shardforge.errors import MergeError
from shardforge.formats.reference import torch_load
from shardforge.formats.sources import TensorSource
from shardforge.io.copy import ReadCache
from shardforge.io.dtypes import STORAGE_CLASSES, torch_dtype
from shardforge.io.publish import atomic_file
from shardforge.sinks.base import Output, Progress, Sink, WriteOptions, verified_line
from shardforge.sinks.plan import TensorSpec
from shardforge.sinks.progress import progress

log = logging.getLogger("shardforge")

STATE_DICT_KEY = "state_dict"
PICKLE_PROTOCOL = 2  # torch.save's default
VERIFY_BLOCK = 256 << 20  # bytes compared per mapping of the written file

# dtype -> the typed storage class torch.save names in the pickle (from `io.dtypes`' table)
STORAGE_TYPES: dict[torch.dtype, str] = {torch_dtype(r.name): c for c, r in STORAGE_CLASSES.items()}


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
    with ReadCache() as reader, _open_zipfile_writer(str(path)) as writer:
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
    specs: Sequence[TensorSpec],
    sources: Mapping[str, TensorSource],
    path: Path,
    tied: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Compare every tensor of `path`, as ``torch.load(weights_only=True, mmap=True)`` gives
    it, bit for bit with the checkpoint read independently (`shardforge.sinks.verify`);
    return the number compared.

    The file is mapped, not read; it is mapped afresh after every `VERIFY_BLOCK` bytes
    compared, so the pages already compared are released (memory: about one tensor).
    """
    from shardforge.sinks.verify import bits, compare_all

    state = _load_state(path)
    names = list(state)
    compared = 0

    def compare(name: str, label: str, expected: torch.Tensor) -> None:
        nonlocal state, compared
        if compared > VERIFY_BLOCK:
            state, compared = _load_state(path), 0
        got = state[name]
        if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
            raise _differs(label, path, f"is {got.dtype} {list(got.shape)}")
        if not torch.equal(bits(got), bits(expected)):
            raise _differs(label, path, "differs from the checkpoint")
        compared += expected.nbytes
        if progress is not None:
            progress(expected.nbytes)

    planned = {s.name: s.dtype for s in specs}
    count = compare_all(planned, sources, dict.fromkeys(names, path), tied or {}, compare)
    if names != [s.name for s in specs]:
        raise MergeError(f"verification failed: {path} holds its tensors in another order")
    return count


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    loaded = torch_load(path)
    state = loaded.get(STATE_DICT_KEY) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise MergeError(f"verification failed: {path} does not hold {{'state_dict': tensors}}")
    return state


def _differs(label: str, path: Path, problem: str) -> MergeError:
    return MergeError(
        f"verification failed: {label} in {path} {problem}; the output is not trustworthy"
    )


def saved_order(specs: Sequence[TensorSpec], names: Sequence[str]) -> list[TensorSpec]:
    """`specs` in the order of `names` (the model's state-dict order), the rest after them in
    their own order; linear in the number of tensors (a 100k-tensor MoE checkpoint)."""
    by_name = {s.name: s for s in specs}
    ordered = [by_name.pop(n) for n in names if n in by_name]
    return ordered + list(by_name.values())


class TorchFileSink(Sink):
    """One torch.save-format file ``{"state_dict": ...}``, written one tensor at a time, in
    the model's state-dict order (`Output.names`)."""

    name = "torch"
    single_file = True

    def _specs(self, output: Output) -> list[TensorSpec]:
        return saved_order([t.spec for _, t in output.plan.tensors()], output.names)

    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        specs = self._specs(output)
        with atomic_file(out, options.overwrite) as tmp:
            with progress(sum(s.nbytes for s in specs), "merging", options.quiet) as update:
                write_torch_file(specs, output.sources, tmp / out.name, update)
            if options.verify:
                n = verify_torch_file(specs, output.sources, tmp / out.name, output.tied)
                log.info("%s", verified_line(n, output))

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        return verify_torch_file(
            self._specs(output), output.sources, location, output.tied, progress
        )

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        specs = self._specs(output)
        return [(out.name, len(specs), sum(s.nbytes for s in specs))]

    def total_bytes(self, output: Output) -> int:
        return sum(s.nbytes for s in self._specs(output))
