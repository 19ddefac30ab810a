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
    choose_target,
    config_dtype_name,
    decide_all,
    parse_dtype_name,
    target_line,
)
from shardforge.sinks.plan import TensorSpec

if TYPE_CHECKING:
    import torch


def dtype_choice_name(value: str | torch.dtype | None) -> str | Literal["config"] | None:
    """`--dtype` (or a torch dtype given from Python) as a dtype name, "config" or None."""
    if value is not None and not isinstance(value, str):
        return dtype_name(value)
    return parse_dtype_name(value)


def output_target(
    value: str | torch.dtype | None, config: Any, recorded: str | None = None
) -> tuple[torch.dtype | None, str]:
    """The merge's output dtype (None: as stored) and its plan line: `--dtype` (`value`),
    else the base dtype train `recorded`, else the config's (`sinks.cast.choose_target`)."""
    name, why = choose_target(dtype_choice_name(value), recorded, config_dtype_name(config))
    target = value if value is not None and not isinstance(value, str) else None
    if target is None and name is not None:
        target = torch_dtype(name)
    return target, target_line(name, why)


def output_rules(
    value: str | torch.dtype | None,
    config: Any,
    keep: Sequence[str] = (),
    model: Sequence[KeepPattern] = (),
    recorded: str | None = None,
) -> CastRules:
    """The cast rules of a merge: the output dtype (`output_target`), the `--keep_dtype`
    patterns and the model class's own (`sinks.cast.model_keep_patterns`)."""
    return cast_rules(output_target(value, config, recorded)[0], keep, model)


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
