"""The one zip-record locator, on real `torch.save` records (and Python-written zips): every
member is found where its bytes are, and every inconsistency a damaged or crafted archive can
hold is one clear error naming the file and the record's byte offset."""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardforge.errors import CheckpointError
from shardforge.io.zip_record import (
    check_crc,
    check_view,
    read_member,
    read_zip_record,
)

FIRST = torch.arange(40, dtype=torch.float32).view(5, 8)
SECOND = torch.arange(100, 124, dtype=torch.int64)


def torch_record(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def central_entries(record: bytes) -> dict[str, int]:
    """member name -> offset of its central-directory entry (a torch record has no comment)."""
    n, cd_offset = struct.unpack_from("<H4xI", record, len(record) - 22 + 10)
    out, pos = {}, cd_offset
    for _ in range(n):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", record, pos + 28)
        out[record[pos + 46 : pos + 46 + name_len].decode()] = pos
        pos += 46 + name_len + extra_len + comment_len
    return out


def put(data: bytearray, at: int, fmt: str, *values: int) -> None:
    struct.pack_into(fmt, data, at, *values)


@pytest.fixture
def two_records(tmp_path: Path) -> Iterator[tuple[Path, int, bytes, bytes]]:
    """A file holding two records back to back, as DCP writes a .distcp file."""
    a, b = torch_record(FIRST), torch_record(SECOND)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(a + b)
    yield path, len(a), a, b


def parse(path: Path, start: int, length: int) -> tuple[int, object]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd, read_zip_record(fd, start, length, str(path))
    except BaseException:
        os.close(fd)
        raise


def test_members_of_a_record_inside_a_file(two_records: tuple[Path, int, bytes, bytes]) -> None:
    path, split, _, b = two_records
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, length, tensor in ((0, split, FIRST), (split, len(b), SECOND)):
            record = read_zip_record(fd, start, length, str(path))
            assert set(record.members) >= {
                "archive/data.pkl",
                "archive/byteorder",
                "archive/data/0",
            }
            storage = record.member("archive/data/0")
            assert start < storage.data_offset and storage.data_end <= start + length
            raw = os.pread(fd, storage.size, storage.data_offset)
            assert raw == tensor.numpy().tobytes()
            assert storage.crc32 == zlib.crc32(raw)
            check_crc(fd, storage, str(path))
            check_crc(fd, storage, str(path), block=7)  # several blocks, same answer
            assert read_member(fd, record, record.member("archive/byteorder"), 16) == b"little"
    finally:
        os.close(fd)


def test_a_zip_written_by_python_without_data_descriptors(tmp_path: Path) -> None:
    path = tmp_path / "p.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("r/data.pkl", b"pickle")
        zf.writestr("r/data/0", bytes(range(256)) * 3)
        zf.comment = b"a comment"
    fd = os.open(path, os.O_RDONLY)
    try:
        record = read_zip_record(fd, 0, path.stat().st_size, str(path))
        m = record.member("r/data/0")
        assert os.pread(fd, m.size, m.data_offset) == bytes(range(256)) * 3
        check_crc(fd, m, str(path))
    finally:
        os.close(fd)


def _refused(path: Path, data: bytes, start: int, length: int, *words: str) -> str:
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError) as info:
            read_zip_record(fd, start, length, str(path))
    finally:
        os.close(fd)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"at byte {start}" in message
    for w in words:
        assert w in message, (w, message)
    return message


def test_central_directory_pointing_at_the_neighbour_record(
    two_records: tuple[Path, int, bytes, bytes],
) -> None:
    """The old parser followed the offset into the next record and read its bytes."""
    path, split, a, b = two_records
    data = bytearray(a + b)
    entry = central_entries(a)["archive/data/0"]
    neighbour = split + struct.unpack_from("<I", b, central_entries(b)["archive/data/0"] + 42)[0]
    put(data, entry + 42, "<I", neighbour)
    _refused(path, bytes(data), 0, split, "outside the archive")


def test_central_directory_pointing_at_another_member(
    two_records: tuple[Path, int, bytes, bytes],
) -> None:
    path, split, a, b = two_records
    data = bytearray(a + b)
    entries = central_entries(a)
    pkl_header = struct.unpack_from("<I", a, entries["archive/data.pkl"] + 42)[0]
    put(data, entries["archive/data/0"] + 42, "<I", pkl_header)
    _refused(path, bytes(data), 0, split, "naming another member")


@pytest.mark.parametrize(
    ("field", "fmt", "value", "words"),
    [
        (10, "<H", 8, ("unsupported zip feature", "compressed with method 8")),
        (8, "<H", 0x0809, ("unsupported zip feature", "encrypted")),
        (24, "<I", 10**6, ("two different sizes",)),
        (34, "<H", 3, ("unsupported zip feature", "disks")),
    ],
)
def test_directory_fields(
    two_records: tuple[Path, int, bytes, bytes],
    field: int,
    fmt: str,
    value: int,
    words: tuple[str, ...],
) -> None:
    path, split, a, b = two_records
    data = bytearray(a + b)
    put(data, split + central_entries(b)["archive/data/0"] + field, fmt, value)
    _refused(path, bytes(data), split, len(b), *words)


def test_sizes_that_agree_but_run_past_the_member(
    two_records: tuple[Path, int, bytes, bytes],
) -> None:
    path, split, a, b = two_records
    data = bytearray(a + b)
    entry = split + central_entries(b)["archive/data/0"]
    put(data, entry + 20, "<II", 10**5, 10**5)
    _refused(path, bytes(data), split, len(b), "running into its central directory")
    put(data, entry + 20, "<II", 48, 48)  # a little more: the descriptor no longer matches
    _refused(path, bytes(data), split, len(b), "data descriptor", "disagrees")


def test_local_header_that_disagrees(two_records: tuple[Path, int, bytes, bytes]) -> None:
    path, _, a, _ = two_records
    data = bytearray(a)
    header = struct.unpack_from("<I", a, central_entries(a)["archive/data/0"] + 42)[0]
    put(data, header + 8, "<H", 8)  # method
    _refused(path, bytes(data), 0, len(a), "local header", "disagrees")
    data = bytearray(a)
    put(data, header + 30, "<B", ord("X"))  # the name
    _refused(path, bytes(data), 0, len(a), "naming another member")
    data = bytearray(a)
    put(data, header + 14, "<I", 12345)  # a CRC that is neither zero nor the directory's
    _refused(path, bytes(data), 0, len(a), "local header", "disagrees")


def test_end_of_directory_problems(two_records: tuple[Path, int, bytes, bytes]) -> None:
    path, split, a, b = two_records
    _refused(path, a, 0, len(a) - 1, "no end-of-central-directory")  # cut short by one byte
    _refused(path, a + b, 0, split + 10, "no end-of-central-directory")  # runs into the next
    _refused(path, a[:10], 0, 10, "too short for a zip archive")
    data = bytearray(a)
    put(data, len(a) - 22 + 16, "<I", 7)  # plain and zip64 directory ends disagree
    _refused(path, bytes(data), 0, len(a), "disagree")
    data = bytearray(a)
    put(data, len(a) - 22 + 8, "<HH", 3000, 3000)
    _refused(path, bytes(data), 0, len(a), "disagree")


def test_window_outside_the_file(two_records: tuple[Path, int, bytes, bytes]) -> None:
    path, split, a, b = two_records
    _refused(path, a + b, split, len(b) + 1, "outside the file")
    _refused(path, a + b, -1, 10, "outside the file")


def test_duplicate_and_overlapping_members(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("r/a", b"a" * 64)
        zf.writestr("r/b", b"b" * 64)
    data = bytearray(buf.getvalue())
    entries = central_entries(bytes(data))
    dup = bytearray(data)
    dup[entries["r/b"] + 46 + 2] = ord("a")  # r/b renamed r/a in the directory only
    msg = _refused(tmp_path / "z", bytes(dup), 0, len(dup), "naming another member")
    assert "'r/a'" in msg
    # r/a's sizes (header and directory) grown over r/b's header: overlapping members
    grow = bytearray(data)
    crc = zlib.crc32(bytes(grow[30 + 3 : 30 + 3 + 100]))
    put(grow, 14, "<III", crc, 100, 100)
    put(grow, entries["r/a"] + 16, "<III", crc, 100, 100)
    _refused(tmp_path / "z", bytes(grow), 0, len(grow), "'r/a' and 'r/b' that overlap")


def test_crc_mismatch_and_missing_crc(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": FIRST}, path)
    data = bytearray(path.read_bytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        record = read_zip_record(fd, 0, len(data), str(path))
        storage = record.member("t/data/0")
        pkl = record.member("t/data.pkl")
    finally:
        os.close(fd)
    data[storage.data_offset + 5] ^= 0x10
    data[pkl.data_offset + 3] ^= 0x01
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(
            CheckpointError, match=r"t\.pt: the bytes of 't/data/0' at byte \d+ fail"
        ):
            check_crc(fd, storage, str(path))
        with pytest.raises(CheckpointError, match=r"fails the CRC-32 check of 't/data\.pkl'"):
            read_member(fd, record, pkl, 1 << 20)
        with pytest.raises(CheckpointError, match="at most 10"):
            read_member(fd, record, pkl, 10)
    finally:
        os.close(fd)
    path.write_bytes(bytes(data[: storage.data_offset + 10]))  # cut inside the storage
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="short read"):
            check_crc(fd, storage, str(path))
    finally:
        os.close(fd)


def test_records_written_without_crc_pass(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    set_crc = torch.serialization.set_crc32_options
    before = torch.serialization.get_crc32_options()
    set_crc(False)
    try:
        torch.save({"w": FIRST}, path)
    finally:
        set_crc(before)
    fd = os.open(path, os.O_RDONLY)
    try:
        record = read_zip_record(fd, 0, path.stat().st_size, str(path))
        assert record.member("t/data/0").crc32 == 0
        check_crc(fd, record.member("t/data/0"), str(path))
        read_member(fd, record, record.member("t/data.pkl"), 1 << 20)
    finally:
        os.close(fd)


def test_zip64_directory_fields(tmp_path: Path) -> None:
    """Members over 4 GiB keep their sizes and offsets in zip64 extra fields (torch writes the
    zip64 directory end always): placeholders replaced by those fields, here built small."""
    record = torch_record(FIRST)
    data = bytearray(record)
    entries = central_entries(record)
    pos = entries["archive/data/0"]
    name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
    crc, size = struct.unpack_from("<I4xI", data, pos + 16)
    header = struct.unpack_from("<I", data, pos + 42)[0]
    extra = struct.pack("<HHQQQ", 1, 24, size, size, header)
    entry = bytearray(data[pos : pos + 46 + name_len + extra_len + comment_len])
    put(entry, 20, "<II", 0xFFFFFFFF, 0xFFFFFFFF)
    put(entry, 30, "<H", extra_len + len(extra))
    put(entry, 42, "<I", 0xFFFFFFFF)
    entry[46 + name_len : 46 + name_len] = extra
    data[pos : pos + 46 + name_len + extra_len + comment_len] = entry
    # the directory grew: move both directory ends
    eocd = len(data) - 22
    locator = eocd - 20
    eocd64 = struct.unpack_from("<Q", data, locator + 8)[0] + len(extra)
    cd_size = struct.unpack_from("<Q", data, eocd64 + 40)[0] + len(extra)
    put(data, eocd64 + 40, "<Q", cd_size)
    put(data, locator + 8, "<Q", eocd64)
    put(data, eocd + 12, "<II", cd_size, struct.unpack_from("<I", data, eocd + 16)[0])
    path = tmp_path / "z64"
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        m = read_zip_record(fd, 0, len(data), str(path)).member("archive/data/0")
        assert (m.size, m.crc32) == (size, crc)
        assert os.pread(fd, m.size, m.data_offset) == FIRST.numpy().tobytes()
    finally:
        os.close(fd)
    short = bytearray(data)
    put(short, pos + 46 + name_len + 2, "<H", 16)  # the zip64 field too short for three values
    _refused(path, bytes(short), 0, len(short), "damaged zip64 field")


VIEW = ("f", 100)


@pytest.mark.parametrize(
    ("offset", "size", "stride", "numel", "member", "words"),
    [
        (0, (5, 8), (8, 1), 40, 160, None),
        (8, (4, 8), (8, 1), 40, 160, None),
        (0, (8, 5), (1, 8), 40, 160, None),  # a transposed view
        (3, (4, 6), (0, 1), 9, 36, None),  # stride 0 (expanded) is torch's own
        (10**30, (0, 4), (4, 1), 0, 0, None),  # an empty view reaches nothing
        (1, (5, 8), (8, 1), 40, 160, "reaches element 40 of a storage of 40"),
        (0, (4,), (1000,), 40, 160, "reaches element 3000"),
        (-1, (4,), (1,), 40, 160, "negative"),
        (0, (4, -1), (1, 1), 40, 160, "negative"),
        (0, (4,), (-1,), 40, 160, "negative"),
        (0, (4,), (1, 1), 40, 160, "1 sizes but 2 strides"),
        (0, (4,), (1,), 41, 160, "claims a storage of 41 elements (164 bytes) in a 160"),
        (2**64, (4,), (1,), 40, 160, "reaches element"),
        (0, (2**40, 2**40), (2**40, 1), 2**80, 2**82, None),  # big ints, no overflow
        (0, (2**40, 2**40), (2**40, 1), 2**80, 160, "claims a storage"),
    ],
)
def test_view_bounds(
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    numel: int,
    member: int,
    words: str | None,
) -> None:
    if words is None:
        check_view(*VIEW, offset, size, stride, numel, 4, member)
        return
    with pytest.raises(CheckpointError) as info:
        check_view(*VIEW, offset, size, stride, numel, 4, member)
    assert str(info.value).startswith("f: the tensor record at byte 100 ")
    assert words in str(info.value)
