"""The one zip-record locator: where each member of a ``torch.save`` zip is, checked.

A ``torch.save`` file is a zip archive whose members are stored uncompressed; DCP keeps one
such archive per chunk inside a ``.distcp`` file (at the chunk's byte offset and length), a
per-rank DTensor file is one archive on its own. `read_zip_record` parses the archive found in
a window ``[start, start + length)`` of an open file and trusts nothing it says:

* the end-of-central-directory (and its zip64 form, which torch always writes) lies at the end
  of the window and the central directory ends exactly where it starts;
* every member's local header lies inside the window, before the central directory, and
  agrees with its central-directory entry (name, method, flags, and CRC-32 and sizes unless a
  data descriptor carries them; the descriptor, when present, must agree too);
* every member's data ``[data_offset, data_offset + size)`` lies inside the window and the file,
  and no two members' bytes overlap;
* members are stored (method 0), not encrypted, not split over disks; anything else is an
  "unsupported zip feature" error.

`check_view` bounds a tensor view (storage offset, size, stride) by its storage member, and
`check_crc` compares a member's bytes with the CRC-32 stored for it, streaming in bounded
blocks. Every problem is a one-line `CheckpointError` naming the file and the byte offset.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
import zlib
from dataclasses import dataclass

from shardforge.errors import CheckpointError
from shardforge.io.remote import pread, preadinto

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_EOCD_SIG = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end-of-central-directory locator
_LOCATOR_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end of central directory
_EOCD64_SIG = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central-directory file header
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"

_ZIP64_EXTRA = 0x0001
_MAX_COMMENT = 0xFFFF
_FLAG_ENCRYPTED = 0x0001
_FLAG_DESCRIPTOR = 0x0008
_FLAG_STRONG_ENCRYPTION = 0x0040
_FLAG_UTF8 = 0x0800
_FLAG_MASKED_HEADERS = 0x2000
_STORED = 0

CRC_BLOCK = 8 << 20  # bytes read at a time by `check_crc`
# a central directory (read whole): torch writes about 100 bytes per member, so this is room
# for over half a million tensors in one file, far beyond any model's state dict
MAX_DIRECTORY = 64 << 20


@dataclass(frozen=True)
class ZipMember:
    """One stored member of a zip record: its bytes are ``[data_offset, data_offset + size)``
    of the file (absolute offsets), and `crc32` is the CRC-32 the writer stored for them."""

    name: str
    header_offset: int  # absolute offset of the member's local header
    data_offset: int
    size: int
    crc32: int

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size


@dataclass(frozen=True)
class ZipRecord:
    """The members of the zip archive at ``[start, start + length)`` of `label`'s file."""

    label: str  # the file, for messages
    start: int
    length: int
    members: dict[str, ZipMember]

    def member(self, name: str) -> ZipMember:
        found = self.members.get(name)
        if found is None:
            raise self.error(f"has no member {_show(name)}")
        return found

    def error(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"{self.label}: the zip record at byte {self.start} {problem}; the checkpoint is "
            "damaged or truncated"
        )


def _show(name: str) -> str:
    """A member name for a message: at most 80 characters of it."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """`n` bytes at `offset`; fewer only when the file ends first (the caller checks)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        data = pread(fd, n - got, offset + got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


class _Parser:
    def __init__(self, fd: int, start: int, length: int, file_size: int, label: str) -> None:
        self.fd, self.start, self.length, self.file_size = fd, start, length, file_size
        self.end = start + length
        self.label = label

    def fail(self, problem: str) -> CheckpointError:
        return ZipRecord(self.label, self.start, self.length, {}).error(problem)

    def unsupported(self, feature: str) -> CheckpointError:
        return CheckpointError(
            f"{self.label}: the zip record at byte {self.start} uses an unsupported zip feature "
            f"({feature}); only uncompressed torch.save records are read"
        )

    def read(self, rel: int, n: int, what: str) -> bytes:
        """`n` bytes at window offset `rel`, all inside the window and the file."""
        if rel < 0 or n < 0 or rel + n > self.length:
            raise self.fail(f"points outside itself ({what} at {rel}, {n} bytes)")
        data = _pread_exact(self.fd, n, self.start + rel)
        if len(data) != n:
            raise self.fail(f"is cut off (file ends inside the {what})")
        return data

    def parse(self) -> ZipRecord:
        if self.start < 0 or self.length < 0 or self.end > self.file_size:
            raise CheckpointError(
                f"{self.label}: a record at byte {self.start} of length {self.length} lies "
                f"outside the file ({self.file_size} bytes); the file is truncated or the "
                "metadata is damaged"
            )
        entries, cd_offset, cd_size = self._directory()
        members: dict[str, ZipMember] = {}
        spans: list[tuple[int, int, str]] = []
        directory = self.read(cd_offset, cd_size, "central directory")
        pos = 0
        for _ in range(entries):
            member, pos, span_end = self._central_entry(directory, pos, cd_offset)
            if member.name in members:
                raise self.fail(f"lists member {_show(member.name)} twice")
            members[member.name] = member
            spans.append((member.header_offset, span_end, member.name))
        if pos != cd_size:
            raise self.fail(f"has a central directory of {cd_size} bytes but {pos} used")
        spans.sort()
        for (_, a_end, a), (b_start, _, b) in itertools.pairwise(spans):
            if b_start < a_end:
                raise self.fail(f"has members {_show(a)} and {_show(b)} that overlap")
        return ZipRecord(self.label, self.start, self.length, members)

    def _directory(self) -> tuple[int, int, int]:
        """(entries, central directory offset, size), window-relative."""
        if self.length < _EOCD.size:
            raise self.fail(f"is {self.length} bytes, too short for a zip archive")
        eocd_at, eocd = self._find_eocd(128)  # torch writes no archive comment
        if eocd_at < 0 and self.length > 128:
            eocd_at, eocd = self._find_eocd(_EOCD.size + _MAX_COMMENT)
        if eocd_at < 0:
            raise self.fail("has no end-of-central-directory at its end")
        _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, _ = eocd
        cd_end = eocd_at
        loc_at = eocd_at - _LOCATOR.size
        if loc_at >= 0:
            loc = self.read(loc_at, _LOCATOR.size, "zip64 locator")
            if loc[:4] == _LOCATOR_SIG:
                _, loc_disk, eocd64_at, disks = _LOCATOR.unpack(loc)
                if loc_disk != 0 or disks != 1:
                    raise self.unsupported("an archive split over several disks")
                if eocd64_at + _EOCD64.size > loc_at:
                    raise self.fail("has a zip64 end-of-central-directory outside itself")
                rec = _EOCD64.unpack(self.read(eocd64_at, _EOCD64.size, "zip64 directory end"))
                sig, rec_size, _, _, disk64, cd_disk64, n_disk64, n_total64, size64, off64 = rec
                if sig != _EOCD64_SIG or eocd64_at + 12 + rec_size != loc_at:
                    raise self.fail("has a damaged zip64 end-of-central-directory")
                if disk64 != 0 or cd_disk64 != 0:
                    raise self.unsupported("an archive split over several disks")
                for small, big in (
                    (n_disk, n_disk64),
                    (n_total, n_total64),
                    (cd_size, size64),
                    (cd_offset, off64),
                ):
                    if small not in (0xFFFF, 0xFFFFFFFF) and small != big:
                        raise self.fail("has zip64 and plain directory ends that disagree")
                n_disk, n_total, cd_size, cd_offset = n_disk64, n_total64, size64, off64
                cd_end = eocd64_at
        if disk != 0 or cd_disk != 0 or n_disk != n_total:
            raise self.unsupported("an archive split over several disks")
        if cd_offset + cd_size != cd_end:
            raise self.fail(
                f"has a central directory at {cd_offset} ({cd_size} bytes) that does not end "
                f"where the directory end starts ({cd_end})"
            )
        if n_total * _CENTRAL.size > cd_size or cd_size > MAX_DIRECTORY:
            raise self.fail(f"claims {n_total} members in a {cd_size}-byte central directory")
        return n_total, cd_offset, cd_size

    def _find_eocd(self, within: int) -> tuple[int, tuple[int, ...]]:
        """(window offset, fields) of the end-of-central-directory whose comment ends the
        window, searched in its last `within` bytes; (-1, ()) when there is none."""
        tail_len = min(self.length, within)
        tail = self.read(self.length - tail_len, tail_len, "end of central directory")
        i = tail.rfind(_EOCD_SIG)
        while i >= 0:
            if i + _EOCD.size <= len(tail):
                fields = _EOCD.unpack_from(tail, i)
                if i + _EOCD.size + fields[7] == len(tail):
                    return self.length - tail_len + i, fields
            i = tail.rfind(_EOCD_SIG, 0, i)
        return -1, ()

    def _central_entry(
        self, directory: bytes, pos: int, cd_offset: int
    ) -> tuple[ZipMember, int, int]:
        """The central-directory entry at `pos` of `directory`: (member, next entry's position,
        end of the member's bytes)."""
        if pos + _CENTRAL.size > len(directory):
            raise self.fail("has a central directory with fewer entries than it claims")
        fields = _CENTRAL.unpack_from(directory, pos)
        (sig, _, _, flags, method, _, _, crc, csize, usize) = fields[:10]
        name_len, extra_len, comment_len, disk, _, _, header_rel = fields[10:]
        if sig != _CENTRAL_SIG:
            raise self.fail(f"has a damaged central directory at {cd_offset + pos}")
        var_end = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if var_end > len(directory):
            raise self.fail("has a central directory entry running past the directory")
        var = directory[pos + _CENTRAL.size : var_end]
        raw_name = var[:name_len]
        name = raw_name.decode("utf-8" if flags & _FLAG_UTF8 else "cp437", errors="replace")
        if flags & (_FLAG_ENCRYPTED | _FLAG_STRONG_ENCRYPTION | _FLAG_MASKED_HEADERS):
            raise self.unsupported(f"encrypted member {_show(name)}")
        if method != _STORED:
            raise self.unsupported(f"member {_show(name)} compressed with method {method}")
        usize, csize, header_rel, disk = _zip64_fields(
            var[name_len : name_len + extra_len], usize, csize, header_rel, disk, self, name
        )
        if disk != 0:
            raise self.unsupported("an archive split over several disks")
        if csize != usize:
            raise self.fail(f"stores member {_show(name)} with two different sizes")
        data_rel = self._local_header(header_rel, raw_name, flags, method, crc, usize, cd_offset)
        end_rel = data_rel + usize
        if end_rel > cd_offset:
            raise self.fail(f"has member {_show(name)} running into its central directory")
        if flags & _FLAG_DESCRIPTOR:
            end_rel = self._descriptor(end_rel, crc, usize, cd_offset, name)
        member = ZipMember(name, self.start + header_rel, self.start + data_rel, usize, crc)
        return member, pos + _CENTRAL.size + len(var), self.start + end_rel

    def _local_header(
        self, rel: int, raw_name: bytes, flags: int, method: int, crc: int, size: int, limit: int
    ) -> int:
        """Check the local header at `rel` against its directory entry; the data's offset."""
        name = raw_name.decode("utf-8", errors="replace")
        if rel + _LOCAL.size > limit:
            raise self.fail(f"has member {_show(name)} whose header lies outside the archive")
        fields = _LOCAL.unpack(self.read(rel, _LOCAL.size, "local header"))
        sig, _, lflags, lmethod, _, _, lcrc, lcsize, lusize, name_len, extra_len = fields
        if sig != _LOCAL_SIG:
            raise self.fail(f"has no local header for member {_show(name)} at {rel}")
        if lflags != flags or lmethod != method:
            raise self.fail(
                f"has a local header for {_show(name)} that disagrees with its directory"
            )
        var = self.read(rel + _LOCAL.size, name_len + extra_len, "local header")
        if var[:name_len] != raw_name:
            raise self.fail(f"has a local header at {rel} naming another member than {_show(name)}")
        lusize, lcsize, _, _ = _zip64_fields(var[name_len:], lusize, lcsize, 0, 0, self, name)
        # with a data descriptor (torch always writes one) the header may leave these zero
        deferred = bool(flags & _FLAG_DESCRIPTOR)
        for got, want in ((lcrc, crc), (lcsize, size), (lusize, size)):
            if got != want and not (deferred and got == 0):
                raise self.fail(
                    f"has a local header for {_show(name)} that disagrees with its directory"
                )
        return rel + _LOCAL.size + name_len + extra_len

    def _descriptor(self, rel: int, crc: int, size: int, limit: int, name: str) -> int:
        """Check the data descriptor after a member's data; the end of the member's bytes."""
        room = min(24, limit - rel)
        data = self.read(rel, room, "data descriptor") if room > 0 else b""
        skip = 4 if data[:4] == _DESCRIPTOR_SIG else 0
        for fmt in ("<III", "<IQQ"):
            n = skip + struct.calcsize(fmt)
            if n <= len(data) and struct.unpack_from(fmt, data, skip) == (crc, size, size):
                return rel + n
        raise self.fail(
            f"has a data descriptor for {_show(name)} that disagrees with its directory"
        )


def _zip64_fields(
    extra: bytes, usize: int, csize: int, offset: int, disk: int, parser: _Parser, name: str
) -> tuple[int, int, int, int]:
    """Replace the 0xFFFFFFFF placeholders by the zip64 extra field's 64-bit values."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + n]
        if len(body) != n:
            raise parser.fail(f"has a damaged extra field for member {_show(name)}")
        if tag == _ZIP64_EXTRA:
            values = [usize, csize, offset]
            at = 0
            for i, placeholder in enumerate((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)):
                if values[i] == placeholder:
                    if at + 8 > n:
                        raise parser.fail(f"has a damaged zip64 field for member {_show(name)}")
                    values[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
            if disk == 0xFFFF:
                if at + 4 > n:
                    raise parser.fail(f"has a damaged zip64 field for member {_show(name)}")
                disk = struct.unpack_from("<I", body, at)[0]
            usize, csize, offset = values
        pos += 4 + n
    if 0xFFFFFFFF in (usize, csize) or offset == 0xFFFFFFFF:
        raise parser.unsupported(f"member {_show(name)} with sizes it does not record")
    return usize, csize, offset, disk


def read_zip_record(fd: int, start: int, length: int, label: str) -> ZipRecord:
    """Parse and check the zip archive at ``[start, start + length)`` of the open file `fd`.

    `label` names the file in messages. The file's size is taken from `fd` itself.
    """
    file_size = os.fstat(fd).st_size
    return _Parser(fd, start, length, file_size, label).parse()


def _crc_recorded(member: ZipMember) -> bool:
    """False for a zero CRC-32 on non-empty data: what torch writes with CRC computation
    switched off (``torch.serialization.set_crc32_options(False)``); nothing to compare."""
    return member.crc32 != 0 or member.size == 0


def read_member(fd: int, record: ZipRecord, member: ZipMember, max_bytes: int) -> bytes:
    """A small member's bytes (data.pkl, byteorder), CRC-checked; refused past `max_bytes`."""
    if member.size > max_bytes:
        raise record.error(f"has a {member.size}-byte {_show(member.name)} (at most {max_bytes})")
    data = _pread_exact(fd, member.size, member.data_offset)
    if len(data) != member.size:
        raise record.error(f"is cut off (file ends inside {_show(member.name)})")
    if not _crc_recorded(member):
        return data
    if zlib.crc32(data) != member.crc32:
        raise record.error(f"fails the CRC-32 check of {_show(member.name)}")
    return data


def check_crc(fd: int, member: ZipMember, label: str, block: int = CRC_BLOCK) -> None:
    """Compare `member`'s bytes with its stored CRC-32, reading `block` bytes at a time.

    CheckpointError (naming the file and the member's offset) on a mismatch or a short read.
    Memory: one block. A member written without a CRC (see `_crc_recorded`) passes.
    """
    if not _crc_recorded(member):
        return
    buf = bytearray(min(block, member.size) or 1)
    view = memoryview(buf)
    crc, pos, end = 0, member.data_offset, member.data_end
    while pos < end:
        n = preadinto(fd, view[: min(len(buf), end - pos)], pos)
        if n <= 0:
            raise CheckpointError(
                f"{label}: short read of {_show(member.name)} at byte {pos}; the file is truncated"
            )
        crc = zlib.crc32(view[:n], crc)
        pos += n
    if crc != member.crc32:
        raise CheckpointError(
            f"{label}: the bytes of {_show(member.name)} at byte {member.data_offset} fail their "
            "CRC-32 check; the checkpoint is damaged (restore it from a good copy)"
        )


def check_view(
    label: str,
    where: int,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    storage_numel: int,
    itemsize: int,
    member_size: int,
) -> None:
    """Check that a tensor view lies inside its storage and the storage inside its member.

    torch's rules: sizes, strides and the storage offset are non-negative; an empty view
    reaches no element; otherwise its last reachable element
    ``storage_offset + sum((size - 1) * stride)`` lies below the storage's element count.
    The storage's bytes (``storage_numel * itemsize``) fit in the member. Python integers:
    no value overflows. `where` is the record's byte offset, for the message.
    """

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{label}: the tensor record at byte {where} {problem}; the checkpoint is damaged "
            "or crafted"
        )

    if len(size) != len(stride):
        raise bad(f"has {len(size)} sizes but {len(stride)} strides")
    if storage_numel < 0 or storage_offset < 0 or min((*size, *stride), default=0) < 0:
        raise bad(
            f"has a negative size, stride or offset (offset {storage_offset}, size "
            f"{list(size)[:8]}, stride {list(stride)[:8]})"
        )
    if storage_numel * itemsize > member_size:
        raise bad(
            f"claims a storage of {storage_numel} elements ({storage_numel * itemsize} bytes) "
            f"in a {member_size}-byte member"
        )
    if math.prod(size) == 0:
        return
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= storage_numel:
        raise bad(
            f"reaches element {last} of a storage of {storage_numel} (offset {storage_offset}, "
            f"size {list(size)[:8]}, stride {list(stride)[:8]})"
        )
