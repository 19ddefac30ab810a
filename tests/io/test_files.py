"""`open_regular`: regular files inside their checkpoint only; special files are refused at
once (never waited on); short reads are errors, never zeros."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shardforge.errors import CheckpointError
from shardforge.io.files import inside, open_regular, read_exact_into


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
