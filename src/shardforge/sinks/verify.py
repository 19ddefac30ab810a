"""`--verify`: read the written files back and compare every tensor, bit for bit, with the
checkpoint read by another path than the write.

The write reads the checkpoint through shardforge's own record parser (zip locator, allow-list
unpickler, slabs). Verification does not use it for any tensor byte:

* a DCP checkpoint is read by torch's own DCP reader (`dcp.load` into preallocated tensors,
  ``no_dist``), fed the `.metadata` parsed by the allow-list unpickler (`SafeFileSystemReader`);
* per-rank DTensor files are read by ``torch.load(weights_only=True, mmap=True)`` and each full
  tensor is assembled where torch's own placement arithmetic puts each rank's local tensor
  (``DTensor.__create_chunk_list__``);
* a safetensors file (a base model, a LoRA adapter) is read by the `safetensors` library;
* averaged, reordered (torchtitan) and LoRA-fused tensors are recomputed from those tensors;
* the output is read by the `safetensors` library.

A tensor in the output that the checkpoint does not have, a checkpoint tensor missing from the
output (a tied copy counts as present when it equals what was stored for it), or any differing
bit is a `MergeError` naming the tensor. Every zip record the compared tensors live in is also
checked against its stored CRC-32 (`shardforge.io.zip_record.check_crc`).

Memory: the tensors of one batch (at most `BATCH_BYTES` of stored data, or one larger tensor),
torch's copy of one stored chunk, and one block of the output at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardforge.errors import CheckpointError, MergeError
from shardforge.formats.base import ReferenceReader, StoredTensor
from shardforge.formats.reference import verify_failed as _fail
from shardforge.formats.registry import format_named
from shardforge.formats.sources import TensorSource
from shardforge.io.dtypes import safetensors_code
from shardforge.sinks.plan import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    OutputPlan,
)

# compare the output in blocks of rows of about this many bytes
BLOCK_BYTES = 16 << 20
# stored bytes read by one batch of the independent reader (a larger tensor is read alone)
BATCH_BYTES = 64 << 20

Progress = Callable[[int], None]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as integers (so NaNs and signed zeros compare exactly), in the
    widest integer type that divides them (comparing 8 bytes at a time is much faster)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    for wide in (torch.int64, torch.int32, torch.int16):
        if raw.numel() % wide.itemsize == 0:
            if raw.data_ptr() % wide.itemsize:
                raw = raw.clone()  # aligned
            return raw.view(wide)
    return raw


# ---------------------------------------------------------------- the output, as safetensors


def written_weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file, as a loader finds them (the index, else model.safetensors)."""
    from safetensors import safe_open

    index = directory / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    with safe_open(str(directory / SAFE_WEIGHTS_NAME), framework="pt") as f:
        return dict.fromkeys(f.keys(), SAFE_WEIGHTS_NAME)


def output_tensors(directory: Path) -> dict[str, Path]:
    """Every tensor of the output directory and its file, as the safetensors library lists
    them; the index and the files must agree (a tensor in a file but not in the index, or the
    other way round, fails)."""
    from safetensors import safe_open

    weight_map = written_weight_map(directory)
    found: dict[str, Path] = {}
    for filename in sorted(set(weight_map.values())):
        path = directory / filename
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if weight_map.get(name) != filename:
                    raise _fail(name, path, "is not listed for this file in the index")
                found[name] = path
    for name, filename in weight_map.items():
        if name not in found:
            raise _fail(name, directory / filename, "is listed in the index but missing")
    return found


def _compare_output(
    name: str,
    path: Path,
    expected: torch.Tensor,
    progress: Progress | None,
    block_bytes: int,
    label: str | None = None,
) -> None:
    """Compare `expected` with tensor `name` of `path`, block of rows by block of rows (a
    fresh handle per block, so only that block's pages are mapped)."""
    from safetensors import safe_open

    shown = label or name
    with safe_open(str(path), framework="pt") as f:
        sl = f.get_slice(name)
        dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
    want = safetensors_code(expected.dtype)
    if dtype != want:
        raise _fail(shown, path, f"is {dtype}, not {want}")
    if shape != tuple(expected.shape):
        raise _fail(shown, path, f"has shape {list(shape)}, not {list(expected.shape)}")
    if not shape:
        with safe_open(str(path), framework="pt") as f:
            got = f.get_tensor(name)
        if not torch.equal(bits(got), bits(expected)):
            raise _fail(shown, path, "differs from the checkpoint")
        if progress is not None:
            progress(expected.element_size())
        return
    row_bytes = max(1, math.prod(shape[1:]) * expected.element_size())
    step = max(1, block_bytes // row_bytes)
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        with safe_open(str(path), framework="pt") as f:
            got = f.get_slice(name)[start:stop]
        if not torch.equal(bits(got), bits(expected[start:stop])):
            raise _fail(shown, path, f"differs from the checkpoint (rows {start} to {stop - 1})")
        if progress is not None:
            progress(got.numel() * got.element_size())


# ------------------------------------------------------------ the checkpoint, read by torch


class IndependentReader:
    """The checkpoint's stored tensors, read by torch (one reader per checkpoint folder)."""

    def __init__(self) -> None:
        self._readers: dict[tuple[str, Path], ReferenceReader] = {}

    def _reader(self, fmt: str, directory: Path) -> ReferenceReader:
        key = (fmt, directory)
        if key not in self._readers:
            try:
                self._readers[key] = format_named(fmt).reference(directory)
            except CheckpointError as exc:
                raise MergeError(f"verification failed: {exc.message}") from None
        return self._readers[key]

    def load(self, wanted: Sequence[StoredTensor]) -> dict[StoredTensor, torch.Tensor]:
        """Every `wanted` tensor, the zip records it lives in CRC-checked."""
        groups: dict[tuple[str, Path], list[StoredTensor]] = {}
        for s in dict.fromkeys(wanted):
            groups.setdefault((s.fmt, s.directory), []).append(s)
        out: dict[StoredTensor, torch.Tensor] = {}
        for (fmt, directory), items in groups.items():
            reader = self._reader(fmt, directory)
            try:
                reader.check_crcs({s.key for s in items})
            except CheckpointError as exc:
                raise MergeError(f"verification failed: {exc.message}") from None
            loaded = reader.load(items)
            for s in items:
                out[s] = loaded[s.key]
        return out


# ------------------------------------------------------------------------------ comparison


@dataclass(frozen=True)
class _Check:
    name: str  # the checkpoint tensor (HF name)
    source: TensorSource
    dtype: torch.dtype  # as written
    output: str  # the output tensor holding it (itself, or its tied source)


def _checks(
    plan_dtypes: Mapping[str, torch.dtype],
    sources: Mapping[str, TensorSource],
    outputs: Mapping[str, object],
    tied: Mapping[str, str],
) -> list[_Check]:
    """What to compare, once every name is accounted for on both sides."""
    for name, path in outputs.items():
        if name not in plan_dtypes:
            raise _fail(name, str(path), "is not a tensor of the checkpoint")
    checks = []
    for name, dtype in plan_dtypes.items():
        if name not in outputs:
            raise _fail(name, "the output", "is missing")
        checks.append(_Check(name, sources[name], dtype, name))
    for name, source in sources.items():
        if name in plan_dtypes:
            continue
        kept = tied.get(name)
        if kept is None or kept not in plan_dtypes:
            raise _fail(name, "the output", "is missing (the checkpoint has it)")
        checks.append(_Check(name, source, plan_dtypes[kept], kept))
    return checks


def _batches(checks: list[_Check], batch_bytes: int) -> Iterator[list[_Check]]:
    """Checks in batches of about `batch_bytes` of stored tensors, each stored tensor counted
    once per batch (the experts cut from one fused tensor share it: read once)."""
    batch: list[_Check] = []
    seen: set[StoredTensor] = set()
    size = 0
    for check in checks:
        stored = check.source.stored()
        n = sum(s.nbytes for s in stored if s not in seen)
        if batch and size + n > batch_bytes:
            yield batch
            batch, seen, size = [], set(), 0
            n = sum(s.nbytes for s in dict.fromkeys(stored))
        batch.append(check)
        seen.update(stored)
        size += n
    if batch:
        yield batch


def compare_all(
    planned: Mapping[str, torch.dtype],
    sources: Mapping[str, TensorSource],
    outputs: Mapping[str, object],
    tied: Mapping[str, str],
    compare: Callable[[str, str, torch.Tensor], None],
    batch_bytes: int = BATCH_BYTES,
    only: Callable[[str], bool] | None = None,
) -> int:
    """Account for every name on both sides, then call ``compare(output name, label,
    expected)`` for each checkpoint tensor, read independently and cast as written; return the
    number compared.

    `planned`: output name -> dtype written; `sources`: every checkpoint tensor by HF name;
    `outputs`: the names the output holds (-> where, for messages); `tied`: tied target -> the
    name stored for it (a stored copy of a target must equal the tensor written for it).
    """
    checks = _checks(planned, sources, outputs, tied)
    if only is not None:  # one rank's share: every name is still accounted for above
        checks = [c for c in checks if only(c.output)]
    reader = IndependentReader()
    for batch in _batches(checks, batch_bytes):
        loaded = reader.load([s for c in batch for s in c.source.stored()])
        for c in batch:
            expected = c.source.combine([loaded[s] for s in c.source.stored()]).to(c.dtype)
            label = c.name if c.output == c.name else f"{c.name} (tied: stored as {c.output})"
            compare(c.output, label, expected)
            del expected
        del loaded
    return len(checks)


def verify_output(
    plan: OutputPlan,
    sources: Mapping[str, TensorSource],
    directory: Path,
    progress: Progress | None = None,
    tied: Mapping[str, str] | None = None,
    block_bytes: int = BLOCK_BYTES,
    batch_bytes: int = BATCH_BYTES,
    only: Callable[[str], bool] | None = None,
) -> int:
    """Compare every tensor of the safetensors output in `directory` (read by the safetensors
    library) with the checkpoint read independently (see the module docstring); return the
    number of tensors compared. `only`: compare just the output names it accepts (a rank's
    share of a distributed merge; the accounting of every name still runs)."""
    outputs = output_tensors(directory)
    planned = {t.spec.name: t.spec.dtype for _, t in plan.tensors()}

    def compare(name: str, label: str, expected: torch.Tensor) -> None:
        _compare_output(name, outputs[name], expected, progress, block_bytes, label)

    return compare_all(planned, sources, outputs, tied or {}, compare, batch_bytes, only)
