"""What every torch.save pickle shares (`shardforge.formats.torchsave`): storage references
read as torch writes them and refused otherwise, tensors described not loaded, and the one
``data.pkl`` of a file found through the checked zip locator."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from shardforge.errors import CheckpointError
from shardforge.formats.torchsave import (
    STORAGE_TYPES,
    UNTYPED_STORAGE,
    LocalTensor,
    StorageRef,
    read_data_pkl,
    rebuild_tensor,
    rebuild_tensor_v3,
    storage_ref,
)
from shardforge.io.unpickler import Opaque, Problem

FLOAT = STORAGE_TYPES[("torch", "FloatStorage")]


def test_storage_references() -> None:
    ref = storage_ref(("storage", FLOAT, "7", "cpu", 12))
    assert ref == StorageRef("7", torch.float32, 12)
    opaque = Opaque("torch.UntypedStorage", named=True)
    assert storage_ref(("storage", opaque, "0", "cpu", 2)) is opaque  # left to the profile
    for pid, message in (
        (("module", FLOAT, "0", "cpu", 1), "not a storage reference"),
        (("storage", FLOAT, "0", "cpu"), "not a storage reference"),
        (("storage", print, "0", "cpu", 1), "names a function as a storage type"),
        (("storage", FLOAT, "../x", "cpu", 1), "malformed storage key '../x'"),
        (("storage", FLOAT, "0", "cpu", -1), "malformed size for storage '0'"),
        (("storage", FLOAT, "0", "cpu", True), "malformed size for storage '0'"),
    ):
        with pytest.raises(Problem, match=message):
            storage_ref(pid)


def test_tensors_are_described() -> None:
    ref = StorageRef("0", torch.float16, 12)
    assert rebuild_tensor(ref, 4, (2, 4), (4, 1), False, {}) == LocalTensor(ref, 4, (2, 4), (4, 1))
    with pytest.raises(Problem, match="does not reference a storage"):
        rebuild_tensor("0", 0, (1,), (1,))
    with pytest.raises(Problem, match="size that is not a tuple of integers"):
        rebuild_tensor(ref, 0, (1.5,), (1,))


def test_untyped_storages_are_viewed_in_their_dtype() -> None:
    """float8, uint16/32/64 (``_rebuild_tensor_v3`` over an ``UntypedStorage`` of bytes)."""
    raw = storage_ref(("storage", UNTYPED_STORAGE, "3", "cpu", 24))
    assert raw == StorageRef("3", torch.uint8, 24)
    fp8 = rebuild_tensor_v3(raw, 4, (4, 5), (5, 1), False, None, torch.float8_e5m2)
    assert fp8 == LocalTensor(StorageRef("3", torch.float8_e5m2, 24), 4, (4, 5), (5, 1))
    wide = rebuild_tensor_v3(raw, 0, (3,), (1,), False, None, torch.uint64)
    assert wide.storage == StorageRef("3", torch.uint64, 3)
    typed = storage_ref(("storage", FLOAT, "3", "cpu", 6))
    for args, message in (
        ((raw, 0, (5,), (1,), False, None, torch.uint16, None), None),
        ((raw, 0, (5,), (1,), False, None, torch.complex128), "of 24 bytes for torch.complex128"),
        ((raw, 0, (5,), (1,), False, None, "float8"), "without its dtype"),
        ((typed, 0, (5,), (1,), False, None, torch.uint16), "not reference an untyped storage"),
    ):
        if message is None:
            assert rebuild_tensor_v3(*args).storage.numel == 12
            continue
        with pytest.raises(Problem, match=message):
            rebuild_tensor_v3(*args)


def test_data_pkl_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)
    with zipfile.ZipFile(path) as zf:
        expected = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    assert read_data_pkl(path, 1 << 20) == expected
    with pytest.raises(CheckpointError, match=r"x\.pt: .*data\.pkl' \(at most 4\)"):
        read_data_pkl(path, 4)
    path.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=r"^.*x\.pt"):
        read_data_pkl(path, 1 << 20)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/data.pkl", b".")
        zf.writestr("b/data.pkl", b".")
    with pytest.raises(CheckpointError, match=r"no single data\.pkl record"):
        read_data_pkl(path, 1 << 20)
    (tmp_path / "link.pt").symlink_to("/etc/hostname")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_data_pkl(tmp_path / "link.pt", 1 << 20)
