"""One hostile corpus of pickles, for the allow-list unpickler's engine, every format's profile
and every entry point that reads a checkpoint pickle: none may load, none may run its payload,
none may change a class."""

from __future__ import annotations

import os
import pickle
import random
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardforge.errors import CheckpointError
from shardforge.io.unpickler import Profile, Record, unpickle


class Reduce:
    """Pickles as ``fn(*args)``: what a malicious checkpoint would run on a plain pickle.load."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def _build_on(module: str, name: str, attr: str) -> bytes:
    """GLOBAL module.name, then BUILD {attr: None} on it: sets an attribute on a class."""
    key = attr.encode()
    return (
        b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"}X" + struct.pack("<I", len(key)) + key
    ) + b"Nsb."


def _deep_memo_lists(n: int) -> bytes:
    """Lists nested `n` deep while the stack stays two items high (each level is fetched back
    from the memo and wrapped)."""
    out = bytearray(b"\x80\x04]\x94")
    for i in range(1, n):
        out += b"]j" + struct.pack("<I", i - 1) + b"a\x940"
    return bytes(out + b"j" + struct.pack("<I", n - 1) + b".")


def hostile_corpus(marker: Path) -> dict[str, bytes]:
    """name -> pickle bytes; none may be loaded, none may touch `marker`."""
    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "reduce os.system": pickle.dumps(Reduce(os.system, f"touch {marker}"), protocol=2),
        "reduce builtins.eval": pickle.dumps(Reduce(eval, touch), protocol=4),
        "reduce subprocess.Popen": pickle.dumps(
            Reduce(subprocess.Popen, ["touch", str(marker)]), protocol=4
        ),
        "BUILD on DCP Metadata": _build_on(
            "torch.distributed.checkpoint.metadata", "Metadata", "__init__"
        ),
        "BUILD on torch.Size": _build_on("torch", "Size", "__new__"),
        "BUILD on DeviceMesh": _build_on("torch.distributed.device_mesh", "DeviceMesh", "x"),
        "BUILD on torch.Tensor": _build_on("torch", "Tensor", "add"),
        "BUILD on pathlib.Path": _build_on("pathlib", "PosixPath", "open"),
        "BUILD on a dtype": _build_on("torch", "float32", "is_floating_point"),
        "memo LONG_BINGET 2**31": b"\x80\x04j\x00\x00\x00\x80.",
        "memo LONG_BINPUT 2**31": b"\x80\x04Nr\x00\x00\x00\x80.",
        "BINBYTES8 of 2**60 bytes": b"\x80\x04\x8e" + (1 << 60).to_bytes(8, "little") + b"x",
        "BINUNICODE8 of 2**60 bytes": b"\x80\x04\x8d" + (1 << 60).to_bytes(8, "little") + b"x",
        "BYTEARRAY8 of 2**33 bytes": b"\x80\x05\x96" + (1 << 33).to_bytes(8, "little") + b"x",
        "100k MARKs": b"(" * 100_000,
        "100k nested lists": b"]" * 100_000 + b"a" * 99_999 + b".",
        "100k nested tuples": b"N" + b"\x85" * 100_000 + b".",
        "20k nested lists, two on the stack": _deep_memo_lists(20_000),
        "deep tuple as a dict key": b"}N" + b"\x85" * 50_000 + b"Ns.",
        "truncated": pickle.dumps({"w": [list(range(50)), "x" * 100]}, protocol=4)[:60],
        "random bytes": random.Random(10).randbytes(4096),
    }


def _watched() -> tuple[type, ...]:
    """torch and pathlib classes (and our record base) a payload would like to change."""
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.device_mesh import DeviceMesh

    from shardforge.formats.dcp.pickles import Metadata

    return (
        m.Metadata,
        m.TensorStorageMetadata,
        m.ChunkStorageMetadata,
        m.TensorProperties,
        m.MetadataIndex,
        m.StorageMeta,
        _StorageInfo,
        torch.Tensor,
        torch.Size,
        DeviceMesh,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        Record,
        Metadata,
    )


def class_snapshot() -> dict[str, dict[str, int]]:
    return {repr(c): {k: id(v) for k, v in vars(c).items()} for c in _watched()}


def check_refusal(message: str, label: str) -> None:
    """One line, printable ASCII, naming the file."""
    assert "\n" not in message, (label, message)
    assert message.isascii() and message.isprintable(), (label, message)
    assert "Traceback" not in message, (label, message)


def refuses_the_corpus(profile: Profile, tmp_path: Path) -> None:
    """Every pickle of the corpus is refused under `profile`: one clean line naming the file,
    fast, no payload run, no watched class changed."""
    marker = tmp_path / "MARKER"
    before = class_snapshot()
    for name, data in hostile_corpus(marker).items():
        start = time.perf_counter()
        with pytest.raises(CheckpointError) as info:
            unpickle(data, "x/data.pkl", profile)
        assert time.perf_counter() - start < 5, name
        check_refusal(str(info.value), name)
        assert str(info.value).startswith("x/data.pkl: "), name
    assert not marker.exists()
    assert class_snapshot() == before
