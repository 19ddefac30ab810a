"""Every dtype a checkpoint may name, in one table known without importing torch.

`DTYPES` has one `DtypeInfo` row per torch dtype: its canonical name and torch's other names,
bytes per element, kind (floating or not), the typed-storage class ``torch.save`` names in a
pickle, and its safetensors code. Every other table is derived from it: `DTYPE_NAMES` (every
name torch gives a dtype), `STORAGE_CLASSES` (what the unpickler allows and the torch-file
writer names) and `SAFETENSORS_CODES` (what a safetensors header may say and the planner
writes). Tests compare the table with the installed torch and the safetensors library.

The merge's head start (`shardforge.merge.overlap`) reads a checkpoint's metadata before
`import torch` has run, so that the byte copy starts at once; everything else reads it with
torch loaded. `lookup_dtype` therefore gives torch's own dtype object once torch is imported,
and before that a `DtypeName` with the same name, element size and kind (all a plan needs).
Nothing here runs code named by a checkpoint: a name is a key of a constant table.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

# what the elements are: "float8" and "float4" are floating kinds of one byte (float4_e2m1fn_x2
# packs two values in a byte); a checkpoint's packed quantized weights (MXFP4 blocks ...) are
# plain uint8 to torch, and "quantized" are torch's qint/quint tensor dtypes
Kind = Literal["float", "float8", "float4", "int", "uint", "bool", "complex", "quantized", "bits"]
FLOATING_KINDS: frozenset[str] = frozenset({"float", "float8", "float4"})
# the kinds an output dtype (`--dtype`) may be cast from: FP8 and FP4 weights are stored with
# scales that a cast would not apply, integers and bools hold indices and counts
CASTABLE_KINDS: frozenset[str] = frozenset({"float"})


@dataclass(frozen=True)
class DtypeInfo:
    """One torch dtype: everything shardforge knows about it (a row of `DTYPES`)."""

    name: str  # torch's canonical name: ``torch.<name>``, what `str()` of the dtype says
    itemsize: int  # bytes per element
    kind: Kind
    aliases: tuple[str, ...] = ()  # torch's other names for it (``torch.half``)
    storage: str | None = None  # the typed-storage class ``torch.save`` names ("BFloat16Storage")
    safetensors: str | None = None  # its code in a safetensors header ("BF16")

    @property
    def is_floating_point(self) -> bool:
        """As torch's ``dtype.is_floating_point`` (complex is not)."""
        return self.kind in FLOATING_KINDS

    @property
    def castable(self) -> bool:
        """Whether an output dtype may be cast from it (`CASTABLE_KINDS`: not FP8/FP4, not an
        integer, bool, complex or quantized dtype)."""
        return self.kind in CASTABLE_KINDS


_I = DtypeInfo
# fmt: off
DTYPES: tuple[DtypeInfo, ...] = (
    #  name                 size  kind          aliases           storage class           safetensors
    _I("float64",             8, "float",      ("double",),      "DoubleStorage",        "F64"),
    _I("float32",             4, "float",      ("float",),       "FloatStorage",         "F32"),
    _I("float16",             2, "float",      ("half",),        "HalfStorage",          "F16"),
    _I("bfloat16",            2, "float",      (),               "BFloat16Storage",      "BF16"),
    _I("float8_e4m3fn",       1, "float8",     (),               None,                   "F8_E4M3"),
    _I("float8_e5m2",         1, "float8",     (),               None,                   "F8_E5M2"),
    _I("float8_e4m3fnuz",     1, "float8"),
    _I("float8_e5m2fnuz",     1, "float8"),
    _I("float8_e8m0fnu",      1, "float8"),
    _I("float4_e2m1fn_x2",    1, "float4"),
    _I("int64",               8, "int",        ("long",),        "LongStorage",          "I64"),
    _I("int32",               4, "int",        ("int",),         "IntStorage",           "I32"),
    _I("int16",               2, "int",        ("short",),       "ShortStorage",         "I16"),
    _I("int8",                1, "int",        (),               "CharStorage",          "I8"),
    _I("uint64",              8, "uint",       (),               None,                   "U64"),
    _I("uint32",              4, "uint",       (),               None,                   "U32"),
    _I("uint16",              2, "uint",       (),               None,                   "U16"),
    _I("uint8",               1, "uint",       (),               "ByteStorage",          "U8"),
    _I("bool",                1, "bool",       (),               "BoolStorage",          "BOOL"),
    _I("complex128",         16, "complex",    ("cdouble",),     "ComplexDoubleStorage"),
    _I("complex64",           8, "complex",    ("cfloat",),      "ComplexFloatStorage",  "C64"),
    _I("complex32",           4, "complex",    ("chalf",)),
    _I("qint32",              4, "quantized"),
    _I("qint8",               1, "quantized"),
    _I("quint8",              1, "quantized"),
    _I("quint4x2",            1, "quantized"),
    _I("quint2x4",            1, "quantized"),
    _I("bits16",              2, "bits"),
    _I("bits8",               1, "bits"),
    _I("bits1x8",             1, "bits"),
    _I("bits2x4",             1, "bits"),
    _I("bits4x2",             1, "bits"),
    _I("uint1",               1, "uint",       ("bit",)),
    *(_I(f"uint{bits}", 1, "uint") for bits in range(2, 8)),
    *(_I(f"int{bits}", 1, "int") for bits in range(1, 8)),
)
# fmt: on

# the safetensors codes in the order of the format's Dtype enum: a file lays out its tensors
# by code, the last first, then by name (tests compare it with the safetensors library's files)
SAFETENSORS_ORDER: tuple[str, ...] = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip

# every name torch gives a dtype (``torch.float``, ``torch.float32``, ...) -> its row
DTYPE_NAMES: dict[str, DtypeInfo] = {
    name: row for row in DTYPES for name in (row.name, *row.aliases)
}
# the typed-storage classes ``torch.save`` names (all a pickle may name) -> the element's row
STORAGE_CLASSES: dict[str, DtypeInfo] = {row.storage: row for row in DTYPES if row.storage}
# the safetensors codes shardforge reads and writes -> the row, in `SAFETENSORS_ORDER`
SAFETENSORS_CODES: dict[str, DtypeInfo] = {
    code: next(row for row in DTYPES if row.safetensors == code) for code in SAFETENSORS_ORDER
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
        return DtypeName(known.name, known.itemsize, known.is_floating_point)
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def is_dtype(value: Any) -> bool:
    """True for torch's dtype objects and for `DtypeName`s."""
    if isinstance(value, DtypeName):
        return True
    torch = _torch()
    return torch is not None and isinstance(value, torch.dtype)


def torch_ready() -> bool:
    """Whether torch's import has finished (dtypes read from now on are torch's own)."""
    return _torch() is not None


def resolve_dtype(dtype: Any) -> Any:
    """A `DtypeName` read before torch was imported, as torch's dtype once torch is; any other
    value as it is."""
    if isinstance(dtype, DtypeName) and torch_ready():
        return lookup_dtype(dtype.name)
    return dtype


def dtype_name(dtype: Any) -> str:
    """The canonical name of a torch dtype or `DtypeName`: ``float32`` for ``torch.float``."""
    return str(dtype).removeprefix("torch.")


def dtype_info(dtype: Any) -> DtypeInfo | None:
    """The row of a torch dtype, a `DtypeName` or any name torch gives a dtype (None: unknown)."""
    return DTYPE_NAMES.get(dtype if isinstance(dtype, str) else dtype_name(dtype))


def safetensors_code(dtype: Any) -> str | None:
    """The safetensors code of a torch dtype or `DtypeName` ("BF16"), None where shardforge
    stores it in no safetensors file."""
    row = dtype_info(dtype)
    return None if row is None else row.safetensors


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype object for any name torch gives a dtype (imports torch; KeyError for a
    name not in the table)."""
    import torch

    value = getattr(torch, DTYPE_NAMES[name].name)
    assert isinstance(value, torch.dtype)
    return value
