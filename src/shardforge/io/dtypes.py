"""The dtypes a checkpoint's pickles may name, known without importing torch.

The merge's head start (`shardforge.merge.overlap`) reads a checkpoint's metadata before
`import torch` has run, so that the byte copy starts at once; everything else reads it with
torch loaded. `lookup_dtype` therefore gives torch's own dtype object once torch is imported,
and before that a `DtypeName` with the same name, element size and kind (all a plan needs).
Nothing here runs code named by a checkpoint: a name is a key of a constant table.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

# every name torch gives a dtype (``torch.float``, ``torch.float32``, ...) ->
# (torch's canonical name, bytes per element, floating point); tests compare it with torch
DTYPE_NAMES: dict[str, tuple[str, int, bool]] = {
    **{
        n: (n, size, True)
        for n, size in [
            ("float64", 8),
            ("float32", 4),
            ("float16", 2),
            ("bfloat16", 2),
            ("float8_e4m3fn", 1),
            ("float8_e4m3fnuz", 1),
            ("float8_e5m2", 1),
            ("float8_e5m2fnuz", 1),
            ("float8_e8m0fnu", 1),
            ("float4_e2m1fn_x2", 1),
        ]
    },
    "double": ("float64", 8, True),
    "float": ("float32", 4, True),
    "half": ("float16", 2, True),
    **{
        n: (n, size, False)
        for n, size in [
            ("int64", 8),
            ("int32", 4),
            ("int16", 2),
            ("int8", 1),
            ("uint64", 8),
            ("uint32", 4),
            ("uint16", 2),
            ("uint8", 1),
            ("bool", 1),
            ("complex128", 16),
            ("complex64", 8),
            ("complex32", 4),
            ("qint32", 4),
            ("qint8", 1),
            ("quint8", 1),
            ("quint4x2", 1),
            ("quint2x4", 1),
            ("bits16", 2),
            ("bits8", 1),
            ("bits1x8", 1),
            ("bits2x4", 1),
            ("bits4x2", 1),
            *((f"int{b}", 1) for b in range(1, 8)),
            *((f"uint{b}", 1) for b in range(1, 8)),
        ]
    },
    "long": ("int64", 8, False),
    "int": ("int32", 4, False),
    "short": ("int16", 2, False),
    "cdouble": ("complex128", 16, False),
    "cfloat": ("complex64", 8, False),
    "chalf": ("complex32", 4, False),
    "bit": ("uint1", 1, False),
}

# the legacy typed-storage classes ``torch.save`` names -> element dtype name
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


@dataclass(frozen=True)
class DtypeName:
    """A torch dtype named by a checkpoint and read before torch is imported: its canonical
    name, element size and kind, spelled as torch spells them (``str()`` is ``torch.NAME``)."""

    name: str
    itemsize: int
    is_floating_point: bool

    def __str__(self) -> str:
        return f"torch.{self.name}"


def _torch() -> Any:
    """The torch module once its import has finished, else None (the head start's copy thread
    parses records while the main thread is still importing torch)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def lookup_dtype(name: str) -> Any:
    """The dtype a pickle names ``torch.<name>``: torch's object when torch is imported (None
    when this torch has no such dtype), else a `DtypeName` (None for a name not in the table).
    Code that may run on both sides of the import compares dtypes by `dtype_name`."""
    known = DTYPE_NAMES.get(name)
    if known is None:
        return None
    torch = _torch()
    if torch is None:
        return DtypeName(*known)
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def is_dtype(value: Any) -> bool:
    """True for torch's dtype objects and for `DtypeName`s."""
    if isinstance(value, DtypeName):
        return True
    torch = _torch()
    return torch is not None and isinstance(value, torch.dtype)


def dtype_name(dtype: Any) -> str:
    """The canonical name of a torch dtype or `DtypeName`: ``float32`` for ``torch.float``."""
    return str(dtype).removeprefix("torch.")
