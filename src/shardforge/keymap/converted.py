"""Sources of the tensors a model is saved as, from the sources of its in-memory tensors
(`keymap.conversion.SavedLayout`):

    by_saved_name = saved_sources(layout, by_memory_name)

A renamed tensor is its source under the saved name. A `SliceSource` is a box of one source
(an expert of a fused ``[E, ...]`` tensor): where the box is one contiguous byte range and the
source has slabs, its slabs are those bytes (copied file to file); otherwise the source is read
once for all the slices cut from it (`SharedValue`) and each slice copied out. A
`ConvertedSource` is one output of a group transformers' reversed converter makes: the group's
sources are read and converted once, and each output handed out once. `written_together`
names the outputs that share such a value (a distributed merge writes them on one rank).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardforge.formats.base import StoredTensor, TensorSource
from shardforge.formats.sources import WholeTensor, combine_each
from shardforge.io.copy import FileSlab, ReadCache
from shardforge.io.files import read_exact_into
from shardforge.keymap.conversion import Group, SavedLayout, Slice, contiguous_span


class SharedValue:
    """A value several sources read: computed on the first read, dropped after the last of
    its `users` read it (memory: one group at a time while they are written in order)."""

    def __init__(self, users: int) -> None:
        self.users, self.left = users, users
        self.value: Any = None
        self.lock = threading.Lock()

    def take(self, compute: Any) -> Any:
        with self.lock:
            value = self.value if self.value is not None else compute()
            self._used(value)
            return value

    def release(self) -> None:
        """A user that does not need the value (it read its bytes another way)."""
        with self.lock:
            self._used(self.value)

    def _used(self, value: Any) -> None:
        # more uses than users (a tensor written twice) only means computing it again
        self.left -= 1
        self.value = value if self.left > 0 else None
        if self.left <= 0:
            self.left = self.users


def _cut_slabs(slabs: list[FileSlab], start: int, nbytes: int) -> list[FileSlab]:
    """The slabs' bytes [start, start + nbytes) of the tensor, as slabs from 0."""
    out = []
    for s in slabs:
        lo, hi = max(start, s.dst_offset), min(start + nbytes, s.dst_offset + s.nbytes)
        if lo < hi:
            out.append(FileSlab(s.path, s.src_offset + lo - s.dst_offset, hi - lo, lo - start))
    return out


def _box(t: torch.Tensor, s: Slice) -> torch.Tensor:
    for dim, (first, n) in enumerate(zip(s.offsets, s.sizes, strict=True)):
        t = t.narrow(dim, first, n)
    return t.reshape(s.shape)


@dataclass(frozen=True)
class SliceSource(WholeTensor):
    """One saved tensor that is a box of another source (`keymap.conversion.Slice`)."""

    inner: TensorSource
    slice: Slice
    shared: SharedValue = field(compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.slice.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def _span(self) -> tuple[int, int] | None:
        span = contiguous_span(self.inner.shape, self.slice.offsets, self.slice.sizes)
        size = self.dtype.itemsize
        return None if span is None else (span[0] * size, span[1] * size)

    def zero_copy(self, reader: ReadCache) -> bool:
        """Whether its bytes come from the source's slabs (never from the shared tensor)."""
        return self._span() is not None and self.inner.slabs(reader) is not None

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        span = self._span()
        slabs = self.inner.slabs(reader) if span is not None else None
        if slabs is None or span is None:
            return None
        self.shared.release()  # its bytes come from the slabs, never from the shared tensor
        return _cut_slabs(slabs, *span)

    def read(self, reader: ReadCache) -> torch.Tensor:
        slabs = self.slabs(reader)
        if slabs is not None:
            buf = bytearray(sum(s.nbytes for s in slabs))
            for s in slabs:
                view = memoryview(buf)[s.dst_offset : s.dst_offset + s.nbytes]
                read_exact_into(reader.fd(s.path), view, s.src_offset, str(s.path))
            flat = (
                torch.frombuffer(buf, dtype=self.dtype) if buf else torch.empty(0, dtype=self.dtype)
            )
            return flat.view(self.shape)
        full = self.shared.take(lambda: self.inner.read(reader))
        return _box(full, self.slice).clone()

    def stored(self) -> tuple[StoredTensor, ...]:
        return self.inner.stored()

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return _box(self.inner.combine(tensors), self.slice).clone()


@dataclass(frozen=True)
class ConvertedSource(WholeTensor):
    """One output of a group transformers' reversed converter makes from several sources."""

    name: str
    group: Group
    inputs: tuple[TensorSource, ...]  # the sources of `group.sources`, in order
    shape: tuple[int, ...]
    dtype: torch.dtype
    shared: SharedValue = field(compare=False, repr=False)

    def slabs(self, reader: ReadCache) -> list[FileSlab] | None:
        return None

    def _convert(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.group.convert(dict(zip(self.group.sources, tensors, strict=True)))

    def read(self, reader: ReadCache) -> torch.Tensor:
        out = self.shared.take(lambda: self._convert([s.read(reader) for s in self.inputs]))
        return out[self.name]

    def stored(self) -> tuple[StoredTensor, ...]:
        return tuple(s for src in self.inputs for s in src.stored())

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._convert(combine_each(self.inputs, tensors))[self.name]


def saved_sources(
    layout: SavedLayout, by_memory: Mapping[str, TensorSource]
) -> dict[str, TensorSource]:
    """Saved name -> source, in save order, for the saved names whose in-memory tensors are
    all in `by_memory` (a group is taken whole or not at all)."""
    made: dict[str, TensorSource] = {}
    for saved, memory in layout.renamed.items():
        if memory in by_memory:
            made[saved] = by_memory[memory]
    for group in layout.groups:
        if not all(s in by_memory for s in group.sources):
            continue
        if group.slices is not None:
            users: dict[str, SharedValue] = {}
            for name, cut in group.slices.items():
                share = users.setdefault(cut.source, SharedValue(0))
                share.users = share.left = share.users + 1
                made[name] = SliceSource(by_memory[cut.source], cut, share)
            continue
        inputs = tuple(by_memory[s] for s in group.sources)
        shared = SharedValue(len(group.outputs))
        stored = {i.dtype for i in inputs}  # a converter moves values, never casts them
        for name in group.outputs:
            dtype = next(iter(stored)) if len(stored) == 1 else layout.dtypes[name]
            made[name] = ConvertedSource(name, group, inputs, layout.shapes[name], dtype, shared)
    return {name: made[name] for name in layout.shapes if name in made}


def written_together(sources: Mapping[str, TensorSource], reader: ReadCache) -> dict[str, int]:
    """Saved name -> group number of the sources that share one value computed in memory (the
    outputs of a group transformers' converter runs; the slices of a source read whole), in
    the order of `sources`. A distributed merge writes each group on one rank: the value is
    computed once and dropped after its last user, as on one rank (every other source may be
    cut by rows anywhere)."""
    in_memory: set[int] = set()  # id() of the SharedValue of a group computed in memory
    for src in sources.values():
        if isinstance(src, ConvertedSource) or (
            isinstance(src, SliceSource) and not src.zero_copy(reader)
        ):
            in_memory.add(id(src.shared))
    numbers: dict[int, int] = {}
    out: dict[str, int] = {}
    for name, src in sources.items():
        if isinstance(src, (ConvertedSource, SliceSource)) and id(src.shared) in in_memory:
            out[name] = numbers.setdefault(id(src.shared), len(numbers))
    return out
