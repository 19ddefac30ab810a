"""The merge's output dtype choices (one copy for every merge command); which tensor gets
which dtype is `sinks.cast.decide`'s."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from shardforge.io.dtypes import dtype_info, dtype_name, torch_dtype
from shardforge.sinks.cast import (
    CastRules,
    Decision,
    KeepPattern,
    cast_rules,
    config_dtype_name,
    decide_all,
    parse_dtype_name,
)
from shardforge.sinks.plan import TensorSpec

if TYPE_CHECKING:
    import torch


def dtype_choice_name(value: str | torch.dtype | None) -> str | Literal["config"] | None:
    """`--dtype` (or a torch dtype given from Python) as a dtype name, "config" or None."""
    if value is not None and not isinstance(value, str):
        return dtype_name(value)
    return parse_dtype_name(value)


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | Literal["config"] | None:
    if value is not None and not isinstance(value, str):
        return value  # a torch dtype, from Python
    name = parse_dtype_name(value)
    if name is None:
        return None
    return "config" if name == "config" else torch_dtype(name)


def config_dtype(config: Any) -> torch.dtype | None:
    """The model config's floating dtype (`dtype`, else `torch_dtype`), None when it names
    none or a non-floating one."""
    name = config_dtype_name(config)
    return None if name is None else torch_dtype(name)


def output_rules(
    value: str | torch.dtype | None,
    config: Any,
    keep: Sequence[str] = (),
    model: Sequence[KeepPattern] = (),
) -> CastRules:
    """The cast rules of a merge: `--dtype` (`value`; the config's dtype when None), the
    `--keep_dtype` patterns and the model class's own (`sinks.cast.model_keep_patterns`)."""
    wanted = parse_dtype(value)
    return cast_rules(config_dtype(config) if wanted == "config" else wanted, keep, model)


def planned_specs(
    tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], rules: CastRules
) -> tuple[list[TensorSpec], dict[str, Decision]]:
    """The planned tensors of (name, stored dtype, shape), each in the dtype `rules` give it,
    and every decision (what `--dtype` casts and keeps, for the dry run)."""
    listed = list(tensors)
    decisions = decide_all(((n, d) for n, d, _ in listed), rules)
    return [TensorSpec(n, decisions[n].dtype, shape) for n, _, shape in listed], decisions


def main_dtype(specs: list[TensorSpec]) -> torch.dtype | None:
    """The dtype config.json names: the floating dtype holding the most bytes (FP8/FP4 weights
    are quantized, not the model's dtype)."""
    sizes: dict[torch.dtype, int] = {}
    for s in specs:
        info = dtype_info(s.dtype)
        if info is not None and info.castable:
            sizes[s.dtype] = sizes.get(s.dtype, 0) + s.nbytes
    return max(sizes, key=lambda d: sizes[d]) if sizes else None
