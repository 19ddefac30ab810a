"""Re-read the written files and compare every tensor, bit for bit, with the checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from shardforge.checkpoint.metadata import TensorEntry
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


def _fail(name: str, path: Path) -> None:
    raise MergeError(
        f"verification failed: {name} in {path} is missing or differs from the checkpoint; the "
        "output is not trustworthy"
    )


def verify_output(
    plan: OutputPlan,
    sources: Mapping[str, Any],
    directory: Path,
    progress: Callable[[int], None] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """Compare every written tensor with its source (cast as the merge cast); return the
    number of tensors compared.

    The output is read back through the safetensors library in blocks (`get_slice`, a fresh
    handle per block so only that block's pages are mapped): for a DCP entry, blocks of rows
    of each chunk, so memory stays at a few blocks whatever the tensor size; for other sources
    (rank files, averages, reordered tensors) the whole tensor. A difference raises MergeError
    naming tensor and file.
    """
    from safetensors import safe_open

    from shardforge.checkpoint.sources import DcpSource, expected_blocks

    weight_map = written_weight_map(directory)
    count = 0
    with ChunkReader() as reader:
        for _, planned in plan.tensors():
            name, dtype = planned.spec.name, planned.spec.dtype
            source = sources[name]
            if isinstance(source, TensorEntry):
                source = DcpSource(source)
            if name not in weight_map:
                _fail(name, directory)
            path = directory / weight_map[name]
            with safe_open(str(path), framework="pt") as f:
                sl = f.get_slice(name)
                if sl.get_dtype() != SAFETENSORS_DTYPES[dtype][0]:
                    _fail(name, path)
                if tuple(sl.get_shape()) != tuple(source.shape):
                    _fail(name, path)
            _compare_blocks(
                expected_blocks(reader, source, dtype, block_bytes), name, path, progress
            )
            count += 1
    return count


def _compare_blocks(
    blocks: Iterator[tuple[tuple[slice, ...], torch.Tensor]],
    name: str,
    path: Path,
    progress: Callable[[int], None] | None,
) -> None:
    """Compare each expected block with the same block of the file (a fresh handle per block,
    so only that block's pages are mapped); the blocks are released on return."""
    from safetensors import safe_open

    for index, expected in blocks:
        with safe_open(str(path), framework="pt") as f:
            got = f.get_slice(name)[index] if index else f.get_tensor(name)
        if got.dtype != expected.dtype or not torch.equal(_bits(got), _bits(expected)):
            _fail(name, path)
        if progress is not None:
            progress(expected.numel() * expected.element_size())
