"""`open_regular`: regular files inside their checkpoint only; special files are refused at
once (never waited on); short reads are errors, never zeros."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.io.files import (
    MAX_JSON_BYTES,
    check_size,
    inside,
    open_regular,
    read_exact_into,
    read_json,
)


def _ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"PK\x03\x04" + bytes(range(60)))
    return d


def test_a_regular_file_inside_opens_blocking(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    fd = open_regular(d / "__0_0.distcp", d)
    try:
        assert os.get_blocking(fd)
        assert os.pread(fd, 4, 0) == b"PK\x03\x04"
    finally:
        os.close(fd)


def test_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    os.mkfifo(d / "__1_0.distcp")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: is a FIFO \(named pipe\), not a"):
        open_regular(d / "__1_0.distcp", d)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/zero", "a character device"), ("/dev", "a directory")]
)
def test_devices_and_directories_are_refused(path: str, kind: str) -> None:
    with pytest.raises(CheckpointError, match=f"is {kind}, not a regular file"):
        open_regular(path, "/")


def test_a_link_leaving_the_checkpoint_is_refused(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    (tmp_path / "elsewhere.distcp").write_bytes(b"x")
    (d / "__1_0.distcp").symlink_to(tmp_path / "elsewhere.distcp")
    (d / "__2_0.distcp").symlink_to("/dev/zero")
    for name in ("__1_0.distcp", "__2_0.distcp"):
        with pytest.raises(CheckpointError, match=f"{name}: resolves to .*outside the checkpoint"):
            open_regular(d / name, d)
    # a link that stays inside is followed
    (d / "__3_0.distcp").symlink_to("__0_0.distcp")
    os.close(open_regular(d / "__3_0.distcp", d))


def test_a_checkpoint_directory_that_is_a_link_is_fine(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    link = tmp_path / "latest"
    link.symlink_to(d)
    assert inside(link / "__0_0.distcp", link)
    os.close(open_regular(link / "__0_0.distcp", link))


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    with pytest.raises(CheckpointError, match=r"__9_0\.distcp: cannot read \(No such file"):
        open_regular(d / "__9_0.distcp", d)


def test_short_reads_are_errors_never_zeros(tmp_path: Path) -> None:
    d = _ckpt(tmp_path)
    fd = open_regular(d / "__0_0.distcp", d)
    try:
        buf = bytearray(16)
        read_exact_into(fd, buf, 48, "f")
        assert bytes(buf) == bytes(range(44, 60))
        with pytest.raises(CheckpointError, match=r"f: short read at byte 64 \(1 bytes missing\)"):
            read_exact_into(fd, bytearray(17), 48, "f")
    finally:
        os.close(fd)


def test_json_of_a_checkpoint_is_read_with_a_size_cap(tmp_path: Path) -> None:
    """trainer_state.json, config.json, an index: refused unread beyond `MAX_JSON_BYTES`,
    nested too deep or not JSON as one line naming the file; inside the folder only."""
    d = _ckpt(tmp_path)
    state = d / "trainer_state.json"
    state.write_text('{"global_step": 40, "log_history": [{"loss": 1.5}]}')
    assert read_json(state, d)["global_step"] == 40
    with state.open("r+b") as f:  # sparse: refused by its size, before a byte is read
        f.truncate(MAX_JSON_BYTES + 1)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        read_json(state, d)
    assert time.monotonic() - start < 1.0
    assert str(info.value) == (
        f"{state}: 16,777,217 bytes, more than the 16,777,216 a trainer_state.json of a "
        "checkpoint or model folder may have; refusing to read it (is it the right file?)"
    )
    config = d / "config.json"
    with config.open("wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(CheckpointError, match="16,777,217 bytes, more than the 16,777,216"):
        check_size(config)  # before transformers parses it
    check_size(d / "missing.json")  # nothing there: the reader says so
    state.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"not valid JSON \(RecursionError: nested too"):
        read_json(state, d)
    state.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: not valid JSON"):
        read_json(state, d)
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (d / "linked.json").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_json(d / "linked.json", d)
