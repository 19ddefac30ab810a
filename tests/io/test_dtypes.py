"""The dtype tables known without torch (io/dtypes.py) against the installed torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardforge.io.dtypes import (
    DTYPE_NAMES,
    STORAGE_DTYPES,
    DtypeName,
    dtype_name,
    is_dtype,
    lookup_dtype,
)


def test_every_torch_dtype_is_in_the_table_with_its_size_and_kind() -> None:
    names = {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}
    assert set(names) <= set(DTYPE_NAMES), sorted(set(names) - set(DTYPE_NAMES))
    for name, value in names.items():
        canonical, itemsize, floating = DTYPE_NAMES[name]
        assert (f"torch.{canonical}", itemsize, floating) == (
            str(value),
            value.itemsize,
            value.is_floating_point,
        ), name


def test_storage_classes_name_the_dtype_of_their_elements() -> None:
    for cls, name in STORAGE_DTYPES.items():
        assert getattr(torch, cls).dtype == lookup_dtype(name), cls


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
