"""The dtype tables known without torch (io/dtypes.py) against the installed torch."""

from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

from shardforge.io.dtypes import (
    DTYPE_NAMES,
    DTYPES,
    SAFETENSORS_CODES,
    SAFETENSORS_ORDER,
    STORAGE_CLASSES,
    DtypeName,
    dtype_info,
    dtype_name,
    is_dtype,
    lookup_dtype,
    safetensors_code,
    torch_dtype,
)


def _torch_dtypes() -> dict[str, torch.dtype]:
    """Every name torch gives a dtype -> the dtype."""
    return {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}


def test_every_torch_dtype_is_in_the_table_with_its_size_and_kind() -> None:
    names = _torch_dtypes()
    assert set(names) <= set(DTYPE_NAMES), sorted(set(names) - set(DTYPE_NAMES))
    for name, value in names.items():
        row = DTYPE_NAMES[name]
        assert (f"torch.{row.name}", row.itemsize, row.is_floating_point) == (
            str(value),
            value.itemsize,
            value.is_floating_point,
        ), name
        assert dtype_info(value) is row and torch_dtype(name) is value, name


def test_one_row_per_dtype_and_every_name_of_it() -> None:
    assert len({row.name for row in DTYPES}) == len(DTYPES)
    assert {row.name for row in DTYPES} == {
        str(v).removeprefix("torch.") for v in _torch_dtypes().values()
    }
    assert set(DTYPE_NAMES) == set(_torch_dtypes())
    assert DTYPE_NAMES["half"] is DTYPE_NAMES["float16"] and DTYPE_NAMES["bit"].name == "uint1"
    assert dtype_info("no_such_dtype") is None and safetensors_code(torch.complex128) is None


def test_storage_classes_name_the_dtype_of_their_elements() -> None:
    for cls, row in STORAGE_CLASSES.items():
        assert getattr(torch, cls).dtype == lookup_dtype(row.name), cls


def _saved_storage_classes(dtype: torch.dtype) -> list[str] | None:
    """The typed-storage classes ``torch.save`` names for a tensor of `dtype` (None: torch
    cannot make or save one)."""
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 and the quantized dtypes warn
            torch.save(torch.zeros(2, dtype=dtype), buf)
    except (NotImplementedError, RuntimeError, KeyError):
        return None
    with zipfile.ZipFile(buf) as zf:
        (pkl,) = [zf.read(n) for n in zf.namelist() if n.endswith("/data.pkl")]
    return [m.decode() for m in re.findall(rb"ctorch\n(\w+Storage)\n", pkl)]


def test_storage_class_is_the_one_torch_save_names() -> None:
    """Every dtype torch.save writes with a typed-storage class has that class in the table
    (the torch-file writer names it; the unpickler allows exactly these)."""
    saved = 0
    for row in DTYPES:
        classes = _saved_storage_classes(torch_dtype(row.name))
        if classes is None:
            assert row.storage is None, row.name
            continue
        saved += 1
        assert classes == ([row.storage] if row.storage else []), row.name
    assert saved >= len(STORAGE_CLASSES)


def test_safetensors_codes_are_the_safetensors_librarys() -> None:
    """Each code names the same dtype and size in the safetensors library."""
    from safetensors.torch import _SIZE, _TYPES

    assert list(SAFETENSORS_CODES) == list(SAFETENSORS_ORDER)
    for code, row in SAFETENSORS_CODES.items():
        assert row.safetensors == code
        assert _TYPES[code] is torch_dtype(row.name), code
        assert _SIZE[_TYPES[code]] == row.itemsize, code
        assert safetensors_code(torch_dtype(row.name)) == code
    assert {r.safetensors for r in DTYPES if r.safetensors} == set(SAFETENSORS_CODES)


def test_safetensors_order_is_the_librarys_layout() -> None:
    """The library lays a file's tensors out by code, the last of `SAFETENSORS_ORDER` first."""
    from safetensors.torch import save

    tensors = {
        code: torch.zeros(2, dtype=torch_dtype(row.name)) for code, row in SAFETENSORS_CODES.items()
    }
    data = save(tensors)
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    laid_out = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    assert laid_out == list(reversed(SAFETENSORS_ORDER))
    assert all(header[code]["dtype"] == code for code in header)


def test_the_users_dtype_choices_are_floating_rows() -> None:
    """`--dtype` and the training config's mixed-precision dtypes name floating dtypes."""
    from typing import get_args

    from shardforge.config.schema import DType
    from shardforge.sinks.cast import DTYPE_CHOICES as MERGE_CHOICES

    names = [n for n in MERGE_CHOICES.values() if n is not None] + list(get_args(DType))
    assert names and all(
        DTYPE_NAMES[n].name == n and DTYPE_NAMES[n].is_floating_point for n in names
    )


def test_only_plain_floating_dtypes_are_castable() -> None:
    """An output dtype casts float64/32/16 and bfloat16 only: FP8/FP4 carry scales, integers,
    bools and packed blocks hold codes (`sinks.cast` keeps them as stored)."""
    castable = {row.name for row in DTYPES if row.castable}
    assert castable == {"float64", "float32", "float16", "bfloat16"}
    assert all(row.is_floating_point for row in DTYPES if row.kind in ("float8", "float4"))
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2", "uint8"):
        assert not DTYPE_NAMES[name].castable, name


def test_with_torch_loaded_a_name_is_torchs_own_dtype() -> None:
    assert lookup_dtype("float") is torch.float32
    assert lookup_dtype("bfloat16") is torch.bfloat16
    assert lookup_dtype("no_such_dtype") is None
    assert is_dtype(torch.int8) and not is_dtype("int8")
    assert dtype_name(torch.half) == "float16"


@pytest.mark.slow
def test_before_torch_is_imported_a_name_is_a_dtype_name() -> None:
    """In a fresh interpreter (as the merge's head start runs): no torch is imported, and the
    stand-in has torch's canonical name, element size and kind."""
    code = (
        "import sys\n"
        "from shardforge.io.dtypes import lookup_dtype, is_dtype, dtype_name\n"
        "d = lookup_dtype('half')\n"
        "assert 'torch' not in sys.modules\n"
        "assert is_dtype(d) and not is_dtype('half')\n"
        "print(type(d).__name__, str(d), d.itemsize, d.is_floating_point, dtype_name(d),"
        " lookup_dtype('no_such_dtype'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["DtypeName", "torch.float16", "2", "True", "float16", "None"]
    assert DtypeName("float16", 2, True) == DtypeName("float16", 2, True)


def test_while_torch_is_still_importing_a_name_is_a_dtype_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head start's copy thread may parse a record while the main thread imports torch:
    until that import has finished, names resolve to `DtypeName`s (torch's attributes may not
    exist yet)."""
    import importlib.machinery
    import types

    half_done = types.ModuleType("torch")
    half_done.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    half_done.__spec__._initializing = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", half_done)
    assert lookup_dtype("float32") == DtypeName("float32", 4, True)
    assert is_dtype(DtypeName("float32", 4, True))
    half_done.__spec__._initializing = False  # type: ignore[attr-defined]
    half_done.dtype = torch.dtype  # type: ignore[attr-defined]
    half_done.float32 = torch.float32  # type: ignore[attr-defined]
    assert lookup_dtype("float32") is torch.float32
