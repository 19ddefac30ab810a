"""Re-read the written files and compare every tensor, bit for bit, with the checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from shardforge.checkpoint.metadata import Chunk, TensorEntry
from shardforge.checkpoint.plan import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFETENSORS_DTYPES,
    OutputPlan,
)
from shardforge.checkpoint.stream import ChunkReader
from shardforge.errors import MergeError

# compare in blocks of rows of about this many bytes (bounds memory for large chunks)
BLOCK_BYTES = 16 << 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes (so NaNs and signed zeros compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def written_weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file, as a loader finds them (the index, else model.safetensors)."""
    from safetensors import safe_open

    index = directory / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    with safe_open(str(directory / SAFE_WEIGHTS_NAME), framework="pt") as f:
        return dict.fromkeys(f.keys(), SAFE_WEIGHTS_NAME)


def _row_blocks(chunk: Chunk, itemsize: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    rows = chunk.sizes[0] if chunk.sizes else 1
    row_bytes = max(1, math.prod(chunk.sizes[1:]) * itemsize)
    step = max(1, block_bytes // row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _fail(name: str, path: Path) -> None:
    raise MergeError(
        f"verification failed: {name} in {path} is missing or differs from the checkpoint; the "
        "output is not trustworthy"
    )


def verify_output(
    plan: OutputPlan,
    sources: dict[str, TensorEntry],
    directory: Path,
    progress: Callable[[int], None] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """Compare every written tensor with its checkpoint chunks (cast as the merge cast);
    return the number of tensors compared.

    The output is read back through the safetensors library in blocks of rows (`get_slice`,
    a fresh handle per block so only that block's pages are mapped): memory stays at a few
    blocks whatever the tensor size. A difference raises MergeError naming tensor and file.
    """
    from safetensors import safe_open

    weight_map = written_weight_map(directory)
    count = 0
    with ChunkReader() as reader:
        for _, planned in plan.tensors():
            name, dtype = planned.spec.name, planned.spec.dtype
            entry = sources[name]
            if name not in weight_map:
                _fail(name, directory)
            path = directory / weight_map[name]
            with safe_open(str(path), framework="pt") as f:
                sl = f.get_slice(name)
                if sl.get_dtype() != SAFETENSORS_DTYPES[dtype][0]:
                    _fail(name, path)
                if tuple(sl.get_shape()) != entry.shape:
                    _fail(name, path)
            for chunk in entry.chunks:
                if not chunk.numel:
                    continue
                for start, stop in _row_blocks(chunk, dtype.itemsize, block_bytes):
                    expected = reader.read_rows(chunk, start, stop).to(dtype)
                    with safe_open(str(path), framework="pt") as f:
                        if entry.shape:
                            index = [
                                slice(o, o + s)
                                for o, s in zip(chunk.offsets, chunk.sizes, strict=True)
                            ]
                            o0 = chunk.offsets[0]
                            index[0] = slice(o0 + start, o0 + stop)
                            got = f.get_slice(name)[tuple(index)]
                        else:
                            got = f.get_tensor(name)
                    if got.dtype != dtype or not torch.equal(_bits(got), _bits(expected)):
                        _fail(name, path)
                    if progress is not None:
                        progress(expected.numel() * expected.element_size())
            count += 1
    return count
