"""The names a model is saved under when they differ from its in-memory names (transformers 5
weight conversion: fused MoE experts saved per expert, renamed modules), as a table of how each
saved tensor comes from the in-memory ones.

    layout = saved_layout(meta_model, meta_state_dict)   # None: saved as it is in memory
    layout.shapes                                       # saved name -> shape, in save order

transformers' ``save_pretrained`` reverts its load-time conversion (``revert_weight_conversion``)
in groups: each in-memory tensor either is renamed, or joins the reversed converter of its
pattern (e.g. ``mlp.experts.gate_up_proj`` [E, 2I, H] -> per expert ``gate_proj.weight`` and
``up_proj.weight``). `saved_layout` groups the tensors as that function does, with
transformers' own pattern matching, runs each group once on the meta device (the saved names,
shapes and dtypes), and where the group's operations only cut one tensor (``Chunk``,
``SplitModulelist``) describes each saved tensor as a box of it (a `Slice`: read from its byte
range, zero-copy where the source has slabs). Any other group keeps transformers' reversed
converter, run on the real tensors of that group alone (`Group.convert`): a group at a time in
memory, never the model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardforge.errors import MergeError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Slice:
    """A saved tensor that is the box [offsets, offsets + sizes) of one in-memory tensor
    (dimensions of size 1 dropped where the converter squeezed them)."""

    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # in the source's dimensions
    shape: tuple[int, ...]  # of the saved tensor


@dataclass(frozen=True)
class Group:
    """In-memory tensors that one reversed converter turns into saved tensors."""

    sources: tuple[str, ...]  # in-memory names, in the order the converter collects them
    outputs: tuple[str, ...]  # saved names
    slices: Mapping[str, Slice] | None  # each output as a box of one source, when it is one
    convert: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] = field(compare=False)


@dataclass(frozen=True)
class SavedLayout:
    """What ``save_pretrained`` writes: every saved name in its order with shape and dtype;
    `renamed`: saved name -> in-memory name of the tensors saved as they are (renamed or not);
    `groups`: the rest."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    renamed: dict[str, str]
    groups: tuple[Group, ...]

    def group_of(self) -> dict[str, Group]:
        """In-memory name -> its group (names outside any group are absent)."""
        return {s: g for g in self.groups for s in g.sources}


def _conversions(model: Any) -> list[Any] | None:
    """The model's load-time conversions, as ``revert_weight_conversion`` finds them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    found = getattr(model, "_weight_conversions", None)
    if found is None:
        found = get_model_conversion_mapping(model, add_legacy=False)
        found = [x for x in found if not isinstance(x, PrefixChange)]
    return list(found) or None


def saved_state_dict(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (real values under the model's in-memory names) as ``save_pretrained`` writes
    them: transformers' own ``revert_weight_conversion`` (fused MoE experts saved per expert,
    renamed modules), each tensor contiguous; as they are on transformers 4.x."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: saved under the in-memory names
        return tensors
    saved = revert_weight_conversion(model, dict(tensors))
    return {name: t.contiguous() for name, t in saved.items()}


def loaded_state_dict(
    model: Any, stored: Mapping[str, torch.Tensor], expected: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The tensors of a saved model as ``from_pretrained`` puts them into `model`: its load-time
    conversions applied (renamed modules, per-expert weights fused into ``gate_up_proj`` /
    ``down_proj``, the base model prefix added or dropped), with transformers' own renaming and
    converters (``rename_source_key``, each group run by its ``WeightConverter``). Keyed like
    `expected` (the model's state-dict names); a stored tensor that lands on no expected name
    is left out, as ``from_pretrained`` leaves it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers 4.x: the stored names are the in-memory names
        return {k: v for k, v in stored.items() if k in expected}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    known = dict(expected)
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, Any] = {}
    for key in sorted(stored, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if name not in expected and key in expected:  # as from_pretrained: only the prefix
            name, pattern = rename_source_key(key, [], [], prefix, known)
        if name not in expected:
            continue
        if pattern is None:
            out[name] = stored[key]
            continue
        group = groups.setdefault(name, copy.deepcopy(by_pattern[pattern]))
        group.add_tensor(name, key, pattern, stored[key])
    for first, group in groups.items():
        for name, value in group.convert(first, model=model, config=model.config).items():
            out[name] = (value[0] if isinstance(value, list) else value).contiguous()
    return out


@dataclass
class _Pending:
    """One group while the state dict is sorted into groups."""

    transform: Any  # the reversed transform, collecting meta tensors
    template: Any  # a converter's unused copy, for runs on real tensors (None: a renaming)
    adds: list[tuple[str, str, str]] = field(default_factory=list)  # (renamed, source, pattern)


def saved_layout(model: Any, state_dict: Mapping[str, torch.Tensor]) -> SavedLayout | None:
    """How `state_dict` (meta tensors, tied targets removed) is saved; None when every tensor is
    saved under its in-memory name."""
    try:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            apply_converters,
            apply_renamings,
            dot_natural_key,
        )
    except ImportError:  # transformers 4.x: names on disk are the in-memory names
        return None
    conversions = _conversions(model)
    if conversions is None:
        return None
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    converters = [r for r in reverse if isinstance(r, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, _Pending] = {}
    for key in sorted(state_dict, key=dot_natural_key):
        made: Any
        renamed, pattern = apply_converters(key, converters)
        if pattern is None:
            renamed, pattern = apply_renamings(key, renamings), key
            made = WeightRenaming(key, renamed)
        else:
            made = copy.deepcopy(by_pattern[pattern])
        group = pending.get(renamed)
        if group is None:  # a converter's unused copy is kept, to run on real tensors
            template = copy.deepcopy(made) if isinstance(made, WeightConverter) else None
            group = pending[renamed] = _Pending(made, template)
        group.transform.add_tensor(renamed, key, pattern, state_dict[key])
        group.adds.append((renamed, key, pattern))
    layout = _realize(model, state_dict, pending, renamings)
    same = all(k == v for k, v in layout.renamed.items()) and not layout.groups
    return None if same else layout


def _realize(
    model: Any,
    state_dict: Mapping[str, torch.Tensor],
    pending: dict[str, _Pending],
    renamings: list[Any],
) -> SavedLayout:
    from transformers.core_model_loading import WeightConverter, apply_renamings

    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    groups = []
    for first, p in pending.items():
        out = p.transform.convert(first, model=model, config=model.config)
        is_converter = isinstance(p.transform, WeightConverter)
        meta: dict[str, Any] = {}
        for target, param in out.items():
            param = param[0] if isinstance(param, list) else param
            meta[apply_renamings(target, renamings) if is_converter else target] = param
        for name, t in meta.items():
            if name in shapes:
                raise MergeError(f"transformers saves two tensors under the name {name!r}")
            shapes[name], dtypes[name] = tuple(t.shape), t.dtype
        if not is_converter:
            if len(p.adds) != 1 or len(meta) != 1:
                names = ", ".join(k for _, k, _ in p.adds)
                raise MergeError(f"transformers saves {names} under one name, {first!r}")
            renamed[next(iter(meta))] = p.adds[0][1]
            continue
        sizes = {name: shapes[name] for name in meta}
        slices = _slices(p, first, model.config, renamings, state_dict, sizes)
        run = _Run(p.template, tuple(p.adds), first, model, tuple(renamings))
        groups.append(Group(tuple(k for _, k, _ in p.adds), tuple(meta), slices, run))
    return SavedLayout(shapes, dtypes, renamed, tuple(groups))


@dataclass(frozen=True)
class _Run:
    """A reversed converter run by transformers on one group's real tensors."""

    template: Any
    adds: tuple[tuple[str, str, str], ...]
    first: str
    model: Any
    renamings: tuple[Any, ...]

    def __call__(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import apply_renamings

        conv = copy.deepcopy(self.template)
        for renamed, key, pattern in self.adds:
            conv.add_tensor(renamed, key, pattern, tensors[key])
        out = conv.convert(self.first, model=self.model, config=self.model.config)
        result = {}
        for target, param in out.items():
            param = param[0] if isinstance(param, list) else param
            result[apply_renamings(target, list(self.renamings))] = param.contiguous()
        return result


# ------------------------------------------------------------------ groups that only cut


@dataclass(frozen=True)
class _Box:
    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    kept: tuple[int, ...]  # the source dimensions the view still has, in order

    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[d] for d in self.kept)

    def chunks(self, dim: int, n: int) -> list[_Box]:
        """``torch.chunk(view, n, dim)``: pieces of ceil(len / n), as many as that makes."""
        d = self.kept[dim]
        total = self.sizes[d]
        step = -(-total // n) if total else 0
        out = []
        for start in range(0, total, step) if step else ():
            size = min(step, total - start)
            offsets = list(self.offsets)
            sizes = list(self.sizes)
            offsets[d] += start
            sizes[d] = size
            out.append(_Box(self.source, tuple(offsets), tuple(sizes), self.kept))
        return out


def _cut(op: Any, boxes: dict[str, Any], transform: Any, config: Any) -> dict[str, Any] | None:
    """What `op` (a ``Chunk`` or ``SplitModulelist``) makes of `boxes`, as its ``convert``
    does with tensors; None for any other operation."""
    from transformers.core_model_loading import Chunk, SplitModulelist

    def one(value: Any) -> _Box:
        return value[0] if isinstance(value, list) else value

    if type(op) is Chunk:
        if len(boxes) != 1:
            return None
        box = one(next(iter(boxes.values())))
        targets = op.get_target_patterns(transform.target_patterns, config=config)
        return dict(zip(targets, box.chunks(op.dim, len(targets)), strict=False))
    if type(op) is SplitModulelist:
        out: dict[str, Any] = {}
        for pattern, value in boxes.items():
            box = one(value)
            n = box.shape()[op.dim]
            targets = op.get_target_patterns(boxes, pattern, transform.target_patterns, n)
            parts = [
                _Box(b.source, b.offsets, b.sizes, b.kept[: op.dim] + b.kept[op.dim + 1 :])
                for b in box.chunks(op.dim, n)
            ]
            out.update(zip(targets, parts, strict=False))
        return out
    return None


def _slices(
    p: _Pending,
    first: str,
    config: Any,
    renamings: list[Any],
    state_dict: Mapping[str, torch.Tensor],
    meta_shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, Slice] | None:
    """Every output of a group as a box of its one source, when the converter only cuts; the
    boxes are taken only if their names and shapes are exactly what the converter made."""
    from transformers.core_model_loading import apply_renamings

    if len(p.adds) != 1:
        return None
    _, key, pattern = p.adds[0]
    shape = tuple(state_dict[key].shape)
    boxes: dict[str, Any] | None = {
        pattern: [_Box(key, (0,) * len(shape), shape, tuple(range(len(shape))))]
    }
    for op in p.template.operations:
        boxes = _cut(op, boxes, p.template, config) if boxes is not None else None
    if boxes is None:
        return None
    full = first.replace("*.", "0.") if "*." in first else first
    found = next((full.partition(k) for k in boxes if k in full), None)
    if found is not None:
        boxes = {found[0] + k + found[2]: v for k, v in boxes.items()}
    named = {apply_renamings(k, renamings): v for k, v in boxes.items()}
    if {k: v.shape() for k, v in named.items()} != dict(meta_shapes):
        return None
    return {k: Slice(key, b.offsets, b.sizes, b.shape()) for k, b in named.items()}


def contiguous_span(
    full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[int, int] | None:
    """(first element, element count) of a box of a C-order tensor of shape `full`, when the
    box is one contiguous range of it; else None."""
    count = math.prod(sizes)
    start, stride = 0, 1
    for d in reversed(range(len(full))):
        start += offsets[d] * stride
        stride *= full[d]
    if count == 0:
        return start, 0
    first_wide = next((d for d, n in enumerate(sizes) if n > 1), len(sizes))
    if any(sizes[d] != full[d] for d in range(first_wide + 1, len(full))):
        return None
    return start, count
