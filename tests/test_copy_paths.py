"""benchmarks/copy_paths.py: each path it times moves the bytes it claims to (not a timing
test: a benchmark that measured a copy of the wrong bytes would mislead the next change)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "copy_paths", ROOT / "benchmarks" / "copy_paths.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_path_writes_the_source_bytes(tmp_path: Path) -> None:
    bench = _module()
    bench.BLOCK = 1 << 20  # several blocks of a small file
    bench.SETTLE_S = 0.0
    src = tmp_path / "src.bin"
    data = os.urandom((3 << 20) + 12_345)
    src.write_bytes(data)
    for name, method in bench.METHODS.items():
        dst = tmp_path / f"{name}.bin"
        bench.measure(method, src, dst)
        got = dst.read_bytes()
        assert len(got) == len(data), name
        if name == "cfr":
            assert got == data
        else:  # shifted as a tensor at an unaligned offset would be, whole pages
            end = bench._aligned_end(len(data))
            assert end > 2 << 20
            assert got[:end] == data[bench.SHIFT : bench.SHIFT + end], name
