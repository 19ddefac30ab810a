"""unfrozen_parameters: train only the parameters whose names match, as Axolotl's
`freeze_layers_except` does.

    freeze_except(model, patterns)  before sharding: requires_grad per name; the row ranges
                                    of the first dimension that stay frozen, per name
    RowFreezer(model, ranges)       after sharding: zeroes the frozen rows of each local
                                    gradient shard after backward (Axolotl: a gradient hook)

A pattern is matched with re.match (from the start of the name); a `.` is a literal dot unless
it is followed by `+`. A trailing `[start:end]`, `[start:]`, `[:end]` or `[i]` (not part of
the regex) trains only those rows of the first dimension: the others' gradients are zeroed.

FSDP2 shards each parameter on its own (a frozen parameter and a trained one may share a
unit: the frozen one gets no gradient and is not reduced), so mixed requires_grad within one
transformer block needs nothing more.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")

_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")
KEY = "unfrozen_parameters"


@dataclass(frozen=True)
class NamePattern:
    """One entry of unfrozen_parameters: a name regex and an optional row range."""

    regex: re.Pattern[str]
    rows: tuple[int, int | None] | None  # [start, end) of the first dimension; None: all

    @classmethod
    def parse(cls, index: int, text: str) -> NamePattern:
        name: str = text
        rows: tuple[int, int | None] | None = None
        found = _RANGE.match(text)
        if found:
            name, start, end = found.groups()
            if end is None and start.isdecimal():
                rows = (int(start), int(start) + 1)
            else:
                rows = (int(start) if start else 0, int(end) if end else None)
                if rows[1] is not None and rows[0] >= rows[1]:
                    raise ConfigError(f"{KEY}[{index}]", [f"{text!r}: an empty row range"])
        try:
            return cls(re.compile(re.sub(r"\.(?!\+)", r"\\.", name)), rows)
        except re.error as exc:
            raise ConfigError(f"{KEY}[{index}]", [f"{text!r} is not a regex ({exc})"]) from None


def _merged(ranges: list[tuple[int, int | None]], size: int) -> list[tuple[int, int]]:
    """The row ranges, ends resolved and overlaps merged, sorted."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((s, size if e is None else e) for s, e in ranges):
        if end > size or start >= end:
            raise ConfigError(KEY, [f"row range [{start}:{end}] outside the {size} rows"])
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for start, end in ranges:
        if start > at:
            out.append((at, start))
        at = max(at, end)
    if at < size:
        out.append((at, size))
    return out


def freeze_except(model: nn.Module, patterns: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Set requires_grad on every parameter of `model` (before sharding): True where a pattern
    matches its name. Returns the frozen row ranges of the parameters trained only in part."""
    parsed = [NamePattern.parse(i, p) for i, p in enumerate(patterns)]
    frozen_rows: dict[str, list[tuple[int, int]]] = {}
    trained = 0
    for name, param in model.named_parameters():
        hits = [p for p in parsed if p.regex.match(name)]
        param.requires_grad = bool(hits)
        trained += bool(hits)
        ranges = [p.rows for p in hits if p.rows is not None]
        if hits and ranges:
            size = int(param.shape[0])
            frozen_rows[name] = _complement(_merged(ranges, size), size)
    if not trained:
        raise ConfigError(KEY, ["no parameter name matches; nothing would be trained"])
    log.debug("unfrozen_parameters: %d parameter(s) trained", trained)
    return {k: v for k, v in frozen_rows.items() if v}


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """(first global row, rows) of this rank's shard of `param` (a DTensor or a tensor)."""
    if not hasattr(param, "device_mesh"):
        return 0, int(param.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape,
        param.device_mesh,
        param.placements,  # type: ignore[attr-defined]
    )
    return int(offset[0]), int(shape[0])


class RowFreezer:
    """Zeroes the gradient rows unfrozen_parameters leaves frozen (after sharding)."""

    def __init__(self, model: nn.Module, frozen_rows: dict[str, list[tuple[int, int]]]) -> None:
        params = dict(model.named_parameters())
        self.targets = [(params[name], ranges) for name, ranges in frozen_rows.items()]

    def __call__(self) -> None:
        for param, ranges in self.targets:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            first, count = local_rows(param)
            for start, end in ranges:
                lo, hi = max(start, first) - first, min(end, first + count) - first
                if lo < hi:
                    local[lo:hi].zero_()
