"""The merge's output dtype choices (one copy for every merge command)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from shardforge.errors import MergeError
from shardforge.io.dtypes import DTYPE_NAMES, dtype_info, dtype_name, is_dtype, torch_dtype
from shardforge.sinks.plan import TensorSpec

if TYPE_CHECKING:
    import torch

# --dtype spellings -> the dtype's name (None: keep each tensor's stored dtype)
DTYPES: dict[str, str | None] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "as_saved": None,
    "as-saved": None,
}


def parse_dtype_name(value: str | None) -> str | Literal["config"] | None:
    """`--dtype` as a dtype name (torch-free: the merge's head start reads it before torch)."""
    if value is None:
        return "config"
    key = value.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise MergeError(f"--dtype {value!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


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


# the model config's attributes naming its dtype, in the order they are read
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")


def config_dtype_name(config: Any) -> str | None:
    """The name of the model config's floating dtype (`dtype`, else `torch_dtype`), None when
    it names none or a non-floating one (torch-free: a config.json's strings suffice)."""
    raw = next((v for k in CONFIG_DTYPE_KEYS if (v := getattr(config, k, None))), None)
    if isinstance(raw, str):
        return DTYPES.get(raw.lower().removeprefix("torch."))
    if not is_dtype(raw):
        return None
    known = DTYPE_NAMES.get(dtype_name(raw))
    return known.name if known is not None and known.is_floating_point else None


def config_dtype(config: Any) -> torch.dtype | None:
    """The model config's floating dtype (`dtype`, else `torch_dtype`), None when it names
    none or a non-floating one."""
    name = config_dtype_name(config)
    return None if name is None else torch_dtype(name)


def output_dtype(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """`target` for a plain floating tensor; any other (integer, bool, float8 and packed
    quantized weights) keeps its stored dtype."""
    row = dtype_info(saved)
    castable = row.kind == "float" if row is not None else saved.is_floating_point
    return target if target is not None and castable else saved


def main_dtype(specs: list[TensorSpec]) -> torch.dtype | None:
    sizes: dict[torch.dtype, int] = {}
    for s in specs:
        if s.dtype.is_floating_point:
            sizes[s.dtype] = sizes.get(s.dtype, 0) + s.nbytes
    return max(sizes, key=lambda d: sizes[d]) if sizes else None
