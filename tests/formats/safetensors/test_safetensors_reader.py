"""The safetensors reader: every tensor equals what the safetensors library loads (by read, by
slab copy); a sharded directory through its index; a crafted header (huge length, offsets
outside the file, overlaps, wrong sizes, unknown dtypes, duplicate names) or an index naming a
file outside the directory is one clean CheckpointError naming the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardforge.errors import CheckpointError
from shardforge.formats.safetensors.reader import (
    MAX_HEADER_BYTES,
    SAFETENSORS,
    open_safetensors_dir,
    open_safetensors_file,
)
from shardforge.io.copy import ReadCache


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5),
        "b.weight": torch.randn(3, 4).bfloat16(),
        "c.half": torch.randn(6).half(),
        "d.ids": torch.arange(9, dtype=torch.int64).reshape(3, 3),
        "e.mask": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.empty(0, 4),
        "h.u8": torch.arange(5, dtype=torch.uint8),
    }


def _slab_bytes(src: Any, reader: ReadCache) -> bytes:
    slabs = src.slabs(reader)
    assert slabs is not None
    out = bytearray(src.nbytes)
    for s in slabs:
        out[s.dst_offset : s.dst_offset + s.nbytes] = os.pread(
            reader.fd(s.path), s.nbytes, s.src_offset
        )
    return bytes(out)


def test_file_round_trip(tmp_path: Path) -> None:
    ts = _tensors()
    path = tmp_path / "model.safetensors"
    save_file(ts, str(path), metadata={"format": "pt"})
    want = load_file(str(path))
    sources = open_safetensors_file(path, tmp_path)
    assert set(sources) == set(want)
    with ReadCache() as reader:
        for name, t in want.items():
            src = sources[name]
            assert (src.dtype, src.shape) == (t.dtype, tuple(t.shape))
            got = src.read(reader)
            assert got.dtype == t.dtype and torch.equal(got, t), name
            # the zero-copy slab is the tensor's C-order bytes
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert _slab_bytes(src, reader) == raw, name
            (stored,) = src.stored()
            assert (stored.fmt, stored.directory, stored.key) == (SAFETENSORS, path, name)
            assert (stored.dtype, stored.shape) == (t.dtype, tuple(t.shape))


def test_sharded_directory_through_the_index(tmp_path: Path) -> None:
    ts = _tensors()
    names = sorted(ts)
    files = {
        "model-00001-of-00002.safetensors": names[:4],
        "model-00002-of-00002.safetensors": names[4:],
    }
    for fname, keys in files.items():
        save_file({k: ts[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in files.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    sources = open_safetensors_dir(tmp_path)
    assert set(sources) == set(ts)
    with ReadCache() as reader:
        for name, t in ts.items():
            assert sources[name].path.name == weight_map[name]
            assert torch.equal(sources[name].read(reader), t)


def test_save_pretrained_directory(tmp_path: Path) -> None:
    from helpers.tiny import make_model

    model_dir = make_model(tmp_path / "m", "qwen2", with_tokenizer=False)
    want = load_file(str(model_dir / "model.safetensors"))
    sources = open_safetensors_dir(model_dir)
    with ReadCache() as reader:
        assert {n: s.read(reader) for n, s in sources.items()}.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(sources[name].read(reader), t)


# ------------------------------------------------------------------------ crafted headers


def _craft(path: Path, header: dict[str, Any], data: bytes, length: int | None = None) -> Path:
    text = json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


def _f32(begin: int, end: int, shape: list[int], dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_HEADERS: dict[str, tuple[dict[str, Any], int, str]] = {
    # name: (header, data bytes, expected words in the message)
    "outside the data": ({"a": _f32(0, 32, [8])}, 16, "outside the data section"),
    "begin after end": ({"a": _f32(16, 8, [2])}, 16, "outside the data section"),
    "overlap": ({"a": _f32(0, 16, [4]), "b": _f32(8, 24, [4])}, 24, "overlap"),
    "wrong size": ({"a": _f32(0, 12, [4])}, 16, "takes 16 bytes"),
    "unknown dtype": ({"a": _f32(0, 4, [8], "F4")}, 4, "unknown dtype"),
    "negative size": ({"a": _f32(0, 0, [-1])}, 0, "not a list of sizes"),
    "bool size": ({"a": _f32(0, 4, [True])}, 4, "not a list of sizes"),
    "offsets not a pair": (
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
        4,
        "[begin, end]",
    ),
    "extra field": ({"a": {**_f32(0, 4, [1]), "x": 1}}, 4, "unknown header fields"),
    "entry not an object": ({"a": [1, 2]}, 0, "not an object"),
    "metadata not strings": ({"__metadata__": {"format": 1}}, 0, "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_header_is_a_clean_error(tmp_path: Path, case: str) -> None:
    header, nbytes, words = BAD_HEADERS[case]
    path = _craft(tmp_path / "x.safetensors", header, b"\0" * nbytes)
    with pytest.raises(CheckpointError) as info:
        open_safetensors_file(path, tmp_path)
    assert str(path) in info.value.message and words in info.value.message


def test_huge_or_short_header_length(tmp_path: Path) -> None:
    path = _craft(tmp_path / "x.safetensors", {"a": _f32(0, 4, [1])}, b"\0" * 4, 1 << 60)
    with pytest.raises(CheckpointError, match="limit of"):
        open_safetensors_file(path)
    path = _craft(tmp_path / "y.safetensors", {}, b"", MAX_HEADER_BYTES)
    with pytest.raises(CheckpointError, match="exceeds the file"):
        open_safetensors_file(path)
    (tmp_path / "z.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="fewer than"):
        open_safetensors_file(tmp_path / "z.safetensors")


def test_bad_json(tmp_path: Path) -> None:
    text = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}'
    dup = tmp_path / "dup.safetensors"
    dup.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    with pytest.raises(CheckpointError, match="appears twice"):
        open_safetensors_file(dup)
    for body in (b"[1, 2]", b"\xff\xfe", b"{" * 5000):
        path = tmp_path / "j.safetensors"
        path.write_bytes(struct.pack("<Q", len(body)) + body)
        with pytest.raises(CheckpointError, match=r"j\.safetensors"):
            open_safetensors_file(path)


def _index(root: Path, weight_map: dict[str, str]) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_index_names_stay_inside_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "model"
    root.mkdir()
    save_file({"a": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    _index(root, {"a": "../outside.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        open_safetensors_dir(root)
    _index(root, {"a": str(tmp_path / "outside.safetensors")})
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        open_safetensors_dir(root)
    (root / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    _index(root, {"a": "link.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        open_safetensors_dir(root)


def test_index_and_files_must_agree(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "m1.safetensors"))
    _index(tmp_path, {"a": "m1.safetensors"})
    with pytest.raises(CheckpointError, match="not listed for it in the index"):
        open_safetensors_dir(tmp_path)
    _index(tmp_path, {"a": "m1.safetensors", "b": "m1.safetensors", "c": "m1.safetensors"})
    with pytest.raises(CheckpointError, match="missing from their files"):
        open_safetensors_dir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match="no weight_map"):
        open_safetensors_dir(tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        open_safetensors_dir(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickle"):
        open_safetensors_dir(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        open_safetensors_dir(tmp_path / "nothing")


def test_truncated_file_is_a_clean_read_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64)}, str(path))
    sources = open_safetensors_file(path)
    with open(path, "r+b") as f:  # shrunk after the header was read
        f.truncate(path.stat().st_size - 16)
    with ReadCache() as reader, pytest.raises(CheckpointError, match="short read"):
        sources["a"].read(reader)
