"""The merge's output dtype choices and its progress bar (one copy for every merge command)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from shardforge.errors import MergeError
from shardforge.merge.plan import TensorSpec

# --dtype spellings -> torch dtype (None: keep each tensor's stored dtype)
DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "as_saved": None,
    "as-saved": None,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | Literal["config"] | None:
    if value is None:
        return "config"
    if isinstance(value, torch.dtype):
        return value
    key = value.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise MergeError(f"--dtype {value!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


# the model config's attributes naming its dtype, in the order they are read
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")


def config_dtype(config: Any) -> torch.dtype | None:
    """The model config's floating dtype (`dtype`, else `torch_dtype`), None when it names
    none or a non-floating one."""
    raw = next((v for k in CONFIG_DTYPE_KEYS if (v := getattr(config, k, None))), None)
    if isinstance(raw, str):
        raw = DTYPES.get(raw.lower().removeprefix("torch."))
    return raw if isinstance(raw, torch.dtype) and raw.is_floating_point else None


def output_dtype(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and saved.is_floating_point else saved


def main_dtype(specs: list[TensorSpec]) -> torch.dtype | None:
    sizes: dict[torch.dtype, int] = {}
    for s in specs:
        if s.dtype.is_floating_point:
            sizes[s.dtype] = sizes.get(s.dtype, 0) + s.nbytes
    return max(sizes, key=lambda d: sizes[d]) if sizes else None


@contextmanager
def progress(total: int, desc: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=disable
    ) as bar:
        yield bar.update
