"""What one output tensor is filled from: a `TensorSource`.

Every kind of input (a DCP entry, a tensor spread over per-rank DTensor files, a tensor that
must be reordered, the mean of several checkpoints' tensors) is a source with a shape, a dtype
and two ways to be read:

* `slabs(reader)`: byte ranges of input files that, copied in order, are the tensor's C-order
  bytes (copied file to file by `io.copy.copy_range`, no tensor), or None when the tensor must
  go through memory;
* `read(reader)`: the whole tensor (in `dtype`, or float32 for an average);

and one way to be used: `write` (the tensor, or some of its rows, cast, at a planned byte range
of an output file: a `Destination`). A DCP entry writes chunk by chunk (memory: one chunk); the
others through one whole tensor. Writers never ask which kind of source they have.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from shardforge.errors import MergeError
from shardforge.formats.base import Described, Destination, Rows, StoredTensor, TensorSource
from shardforge.io.copy import FileSlab, ReadCache, copy_range, pwrite_all, tensor_bytes


def row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize


def write_rows_whole(
    source: TensorSource, reader: ReadCache, dest: Destination, rows: Rows
) -> None:
    """`write` of some rows through one whole tensor in memory (sources without row access)."""
    start, stop = rows
    full = source.read(reader).to(dest.dtype)
    part = full[start:stop] if source.shape else full
    data = tensor_bytes(part.contiguous())
    pwrite_all(dest.fd, data, dest.offset + start * row_bytes(source.shape, dest.dtype))
    dest.progress(data.nbytes)


def _write_whole(source: TensorSource, reader: ReadCache, dest: Destination) -> None:
    """A source's whole tensor at `dest`: its slabs file to file when it has them (no cast),
    else through memory (one tensor)."""
    slabs = source.slabs(reader) if source.dtype == dest.dtype else None
    if slabs is not None:
        for s in slabs:
            copy_range(
                reader.fd(s.path), dest.fd, s.src_offset, dest.offset + s.dst_offset, s.nbytes
            )
            dest.progress(s.nbytes)
        return
    data = tensor_bytes(source.read(reader).to(dest.dtype))
    pwrite_all(dest.fd, data, dest.offset)
    dest.progress(data.nbytes)


def combine_each(
    inputs: Sequence[TensorSource], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each input's tensor (as its `read` gives it) from the stored tensors of all of them, in
    their `stored()` order (verification of a source made of others)."""
    parts, start = [], 0
    for src in inputs:
        n = len(src.stored())
        parts.append(src.combine(tensors[start : start + n]))
        start += n
    return parts


class WholeTensor:
    """`write` through `slabs` / `read` (every source but a DCP entry)."""

    def write(self, reader: ReadCache, dest: Destination, rows: Rows | None = None) -> None:
        if rows is None:
            _write_whole(self, reader, dest)  # type: ignore[arg-type]
        else:
            write_rows_whole(self, reader, dest, rows)  # type: ignore[arg-type]


@dataclass(frozen=True)
class TransformedSource(Described, WholeTensor):
    """Another source's tensor reordered by `transform` (e.g. torchtitan's RoPE q/k rows);
    never zero-copy."""

    inner: TensorSource
    transform: Callable[[torch.Tensor], torch.Tensor]

    @property
    def described(self) -> TensorSource:
        return self.inner

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return None

    def read(self, reader: ReadCache) -> torch.Tensor:
        return self.transform(self.inner.read(reader))

    def stored(self) -> tuple[StoredTensor, ...]:
        return self.inner.stored()

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.transform(self.inner.combine(tensors))


@dataclass(frozen=True)
class AveragedSource(WholeTensor):
    """The element-wise mean of several sources of one name and shape.

    Floating tensors are summed in float32 one input at a time (memory: the accumulator plus
    one input tensor), divided by the count and returned in float32; the writer casts to the
    output dtype. Other dtypes (integer buffers) are taken from the first input.
    """

    inputs: tuple[TensorSource, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.inputs[0].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inputs[0].dtype

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return None if self.dtype.is_floating_point else self.inputs[0].slabs(reader)

    def read(self, reader: ReadCache) -> torch.Tensor:
        if not self.dtype.is_floating_point:
            return self.inputs[0].read(reader)
        acc = torch.zeros(self.shape, dtype=torch.float32)
        for src in self.inputs:
            acc += src.read(reader).to(torch.float32)
        return acc.div_(len(self.inputs))

    def stored(self) -> tuple[StoredTensor, ...]:
        return tuple(s for src in self.inputs for s in src.stored())

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """As `read`, from the inputs' stored tensors (in `stored()` order)."""
        parts = combine_each(self.inputs, tensors)
        if not self.dtype.is_floating_point:
            return parts[0]
        acc = torch.zeros(self.shape, dtype=torch.float32)
        for part in parts:
            acc += part.to(torch.float32)
        return acc.div_(len(self.inputs))


# ---------------------------------------------------------------- LoRA (merge-lora, --merge_lora)


def fuse_lora(
    base: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    transpose: bool = False,
) -> torch.Tensor:
    """``W + scale * B @ A`` in float32, with peft's operations in peft's order
    (`LoraLayer.get_delta_weight` then ``weight += delta``): ``(B @ A)``, transposed for an
    embedding or a fan-in-fan-out layer, times the Python float `scale`, plus W. Each step is
    the same float32 operation as peft's, so a float32 model fuses bit for bit alike."""
    delta = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    if transpose:
        delta = delta.T
    delta = delta.mul_(scale)
    return delta.add_(base.to(torch.float32)).contiguous()  # W + d == d + W in IEEE arithmetic


@dataclass(frozen=True)
class LoraFusedSource(WholeTensor):
    """A base weight with a LoRA adapter's factors fused in (`fuse`), returned in float32 (the
    writer casts to the base's dtype). Memory: the base tensor, its float32 delta, A and B."""

    base: TensorSource
    lora_a: TensorSource
    lora_b: TensorSource

    def fuse(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return None

    def read(self, reader: ReadCache) -> torch.Tensor:
        a, b = self.lora_a.read(reader), self.lora_b.read(reader)
        return self.fuse(self.base.read(reader), a, b)

    def stored(self) -> tuple[StoredTensor, ...]:
        return (*self.base.stored(), *self.lora_a.stored(), *self.lora_b.stored())

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """As `read`, from the stored tensors of base, A and B (in `stored()` order)."""
        base, a, b = combine_each((self.base, self.lora_a, self.lora_b), tensors)
        return self.fuse(base, a, b)


@dataclass(frozen=True)
class FusedLoraSource(LoraFusedSource):
    """A linear layer's or embedding's weight with a LoRA on it: ``base + scale * lora_b @
    lora_a`` (`fuse_lora`).

    `lora_a` is (r, in) and `lora_b` (out, r) for a linear layer; for an embedding
    (`transpose`) peft stores A as (r, num_embeddings) and B as (dim, r) and the delta is
    ``(B @ A).T``.
    """

    scale: float
    transpose: bool = False

    def fuse(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fuse_lora(base, a, b, self.scale, self.transpose)


def param_lora_delta(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    experts: int | None,
    swapped: bool,
    box: tuple[tuple[int, int], ...],
) -> torch.Tensor:
    """The float32 ``B @ A`` of a LoRA on a parameter (peft's `ParamWrapper.get_delta_weight`
    before its scale), for the box (first, size per dimension) of the parameter. A matrix
    (`experts` None) is a linear layer's ``B @ A``; a stack of `experts` matrices takes A as
    (E * r, in) and B as (out, r * E) with the expert fastest, peft's einsum per expert of the
    box: ``e o i`` when peft swapped the parameter's in and out (`swapped`: it is (E, out,
    in)), else ``e i o``."""
    a, b = lora_a.to(torch.float32), lora_b.to(torch.float32)
    if experts is None:
        delta = b @ a
    else:
        (first, count), box = box[0], box[1:]
        a3 = a.reshape(experts, -1, a.shape[-1])[first : first + count]
        b3 = b.reshape(b.shape[0], -1, experts)[:, :, first : first + count]
        delta = torch.einsum(
            "o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b3, a3
        )
    dims = len(delta.shape) - len(box)
    for dim, (first, count) in enumerate(box, start=dims):
        delta = delta.narrow(dim, first, count)
    return delta


def fuse_param_lora(
    base: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    spec: ParamLoraSpec,
) -> torch.Tensor:
    """``W + scale * delta`` in float32 for a box of a parameter LoRA adapts
    (`param_lora_delta`), peft's operations in peft's order (``delta * scaling``, then
    ``param += delta``): a float32 model fuses bit for bit alike."""
    delta = param_lora_delta(lora_a, lora_b, spec.experts, spec.swapped, spec.box) * spec.scale
    return delta.reshape(base.shape).add_(base.to(torch.float32)).contiguous()


@dataclass(frozen=True)
class ParamLoraSpec:
    """How a LoRA on a parameter changes one saved tensor: `scale`, the parameter's `experts`
    (None: a matrix), whether peft swapped its in and out (`swapped`), and the box (first,
    size per dimension of the parameter) the saved tensor is of it."""

    scale: float
    experts: int | None
    swapped: bool
    box: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class FusedParamLoraSource(LoraFusedSource):
    """A saved tensor of a parameter with a LoRA on it (peft's ParamWrapper: fused MoE
    experts, saved one expert per tensor): ``base + scale * delta`` over its box
    (`fuse_param_lora`). Memory: the saved tensor, its delta, A and B."""

    spec: ParamLoraSpec

    def fuse(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fuse_param_lora(base, a, b, self.spec)


def average(
    per_input: Sequence[Mapping[str, TensorSource]], labels: Sequence[str]
) -> dict[str, TensorSource]:
    """name -> AveragedSource over every input; MergeError listing every name, shape or dtype
    that differs between the inputs (all checked before anything is written)."""
    first = per_input[0]
    problems: list[str] = []
    for label, other in zip(labels[1:], per_input[1:], strict=True):
        missing = sorted(set(first) - set(other))
        extra = sorted(set(other) - set(first))
        if missing:
            problems.append(f"{label} lacks {', '.join(missing[:10])}")
        if extra:
            problems.append(f"{label} has extra {', '.join(extra[:10])}")
        for name in sorted(set(first) & set(other)):
            a, b = first[name], other[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(
                    f"{name}: {a.dtype} {list(a.shape)} in {labels[0]} vs {b.dtype} "
                    f"{list(b.shape)} in {label}"
                )
    if problems:
        raise MergeError(
            "cannot average checkpoints of different architectures: "
            + "; ".join(problems[:20])
            + (f" (+{len(problems) - 20} more)" if len(problems) > 20 else "")
        )
    return {name: AveragedSource(tuple(p[name] for p in per_input)) for name in first}
