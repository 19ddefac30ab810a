"""Re-read the written files and compare every tensor, bit for bit, with the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shardforge.checkpoint.metadata import TensorEntry
from shardforge.checkpoint.plan import OutputPlan
from shardforge.checkpoint.stream import ChunkReader, iter_tensors
from shardforge.errors import MergeError


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes (so NaNs and signed zeros compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def verify_output(
    plan: OutputPlan,
    sources: dict[str, TensorEntry],
    directory: Path,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Compare every written tensor with its chunks (cast as the merge cast); return the count.

    Tensors are compared one at a time (memory about two tensors). A difference raises
    MergeError naming the tensor and file.
    """
    from safetensors import safe_open

    count = 0
    with ChunkReader() as reader:
        for fname, name, expected in iter_tensors(plan, sources, reader):
            # one handle per tensor: only this tensor's pages of the file stay mapped
            with safe_open(str(directory / fname), framework="pt") as f:
                got = f.get_tensor(name)
            same = got.dtype == expected.dtype and got.shape == expected.shape
            if not same or not torch.equal(_bits(got), _bits(expected)):
                raise MergeError(
                    f"verification failed: {name} in {directory / fname} differs from the "
                    "checkpoint; the output is not trustworthy"
                )
            count += 1
            if progress is not None:
                progress(expected.numel() * expected.element_size())
    return count
