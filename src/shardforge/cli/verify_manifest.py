"""`shardforge verify` reads ``shardforge-manifest.json`` as untrusted input.

The manifest comes from the directory being checked, so whoever could change the files could
write it too. Before anything in it is used:

1. its size is capped before it is read (`MAX_MANIFEST_BYTES`; a manifest holds about 100 bytes
   per file and per checkpoint record, so the cap is hundreds of thousands of them), and at
   most that many bytes are read even when the file grows meanwhile;
2. its nesting is bounded before JSON parses it (`MAX_DEPTH`; a manifest nests 7 deep): the
   brackets outside strings are counted, so a document nested 200,000 deep is refused at its
   17th bracket, never handed to a recursive parser;
3. it is checked against the schema the writer (`sinks.manifest`) follows: every field of the
   kind written (sizes and offsets non-negative integers, hashes hex digests, CRC-32s 32-bit),
   the first wrong one named in one `error:` line; version 1 (SHA-256 digests) and version 2
   (the digests of the hash its `hash` names: BLAKE3 or SHA-256) are read;
4. every path in it (the output's files, the checkpoint's files) is a plain relative path:
   no absolute path, no ``..``, ``.`` or empty part, no backslash or NUL; on a local disk
   `cli.verify` also refuses a file that resolves outside its directory through a symlink
   (`io.files.inside`, the rule for the storage paths of a checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from shardforge.errors import MergeError, shown
from shardforge.sinks.manifest import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, canonical

# the versions read, and the hash of each file's digest in each (version 2: its `hash`)
VERSIONS = (1, MANIFEST_VERSION)
HASHES = ("blake3", "sha256")

# a manifest is about 100 bytes per file and per checkpoint record: 64 MiB is over 500,000
MAX_MANIFEST_BYTES = 64 << 20
# containers inside containers (a manifest nests 7 deep: source, files, records, crc32)
MAX_DEPTH = 16
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FIX = "not a manifest a shardforge merge wrote; merge again to get one"


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest `data` (read from `where`): bounded, parsed, checked; MergeError naming
    `where` and the first bad entry otherwise."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise too_large(where, len(data))
    check_depth(data, where)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise MergeError(f"{where}: not readable as JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise MergeError(f"{where}: not a {MANIFEST_FORMAT} document")
    if doc.get("version") not in VERSIONS or type(doc.get("version")) is not int:
        raise MergeError(
            f"{where}: version {shown(doc.get('version'))}; this shardforge reads versions "
            f"{', '.join(map(str, VERSIONS))} (a newer shardforge wrote it: verify with that)"
        )
    if doc["version"] > 1 and doc.get("hash") not in HASHES:
        _bad(where, "hash", doc.get("hash"), f"one of {', '.join(HASHES)}")
    if doc.get("checksum") != hashlib.sha256(canonical(doc)).hexdigest():
        raise MergeError(f"{where}: changed after it was written (its own checksum does not match)")
    check_schema(doc, where)
    return doc


def too_large(where: str, size: int) -> MergeError:
    return MergeError(
        f"{where}: {size:,} bytes; a manifest is at most {MAX_MANIFEST_BYTES:,} bytes "
        f"(about 100 bytes per file and record); refusing to read it"
    )


def check_depth(data: bytes, where: str) -> None:
    """Refuse `data` when its brackets outside strings nest more than `MAX_DEPTH` deep."""
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub(b'""', data)):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > MAX_DEPTH:
            raise MergeError(
                f"{where}: nests more than {MAX_DEPTH} levels deep (a manifest nests 7); {_FIX}"
            )


def check_schema(doc: dict[str, Any], where: str) -> None:
    """Every field the verifier reads is of the kind the writer writes."""
    files = _typed(doc.get("files"), dict, "files", where)
    for name, entry in files.items():
        at = f"files[{shown(name)}]"
        _path(name, at, where)
        if name == MANIFEST:
            raise MergeError(f"{where}: lists itself under files; {_FIX}")
        _fields(entry, at, where, size=_count, **{hash_of(doc): _DIGESTS[hash_of(doc)]})
    for i, source in enumerate(_typed(doc.get("source"), list, "source", where)):
        at = f"source[{i}]"
        _fields(source, at, where, location=_text, format=_text)
        for j, entry in enumerate(_typed(source.get("files"), list, f"{at}.files", where)):
            here = f"{at}.files[{j}]"
            _fields(entry, here, where, path=_text, size=_count)
            _path(entry["path"], f"{here}.path", where)
            if "sha256" in entry:
                _fields(entry, here, where, sha256=_sha256)
            records = _typed(entry.get("records", []), list, f"{here}.records", where)
            for k, record in enumerate(records):
                _record(record, f"{here}.records[{k}]", where)


def hash_of(doc: dict[str, Any]) -> str:
    """The hash of the files' digests: version 1's SHA-256, else the one `hash` names."""
    return "sha256" if doc["version"] == 1 else str(doc["hash"])


def _record(record: Any, at: str, where: str) -> None:
    _fields(record, at, where, offset=_count, length=_count)
    crcs = _typed(record.get("crc32"), dict, f"{at}.crc32", where)
    for member, crc in crcs.items():
        if not _crc(crc):
            _bad(where, f"{at}.crc32[{shown(member)}]", crc, "a CRC-32 (0 to 2**32 - 1)")


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _crc(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 32


def _text(value: Any) -> bool:
    return type(value) is str


def _sha256(value: Any) -> bool:
    return type(value) is str and _HEX64.fullmatch(value) is not None


def _blake3(value: Any) -> bool:
    return type(value) is str and _HEX64.fullmatch(value) is not None


_DIGESTS: dict[str, Callable[[Any], bool]] = {"blake3": _blake3, "sha256": _sha256}
_KINDS: dict[Callable[[Any], bool], str] = {
    _count: "a byte count (an integer, 0 or more)",
    _text: "a string",
    _sha256: "a SHA-256 (64 lowercase hex digits)",
    _blake3: "a BLAKE3 (64 lowercase hex digits)",
}


def _fields(entry: Any, at: str, where: str, **checks: Callable[[Any], bool]) -> None:
    _typed(entry, dict, at, where)
    for key, check in checks.items():
        if not check(entry.get(key)):
            _bad(where, f"{at}.{key}", entry.get(key), _KINDS[check])


def _typed(value: Any, kind: type, at: str, where: str) -> Any:
    if type(value) is not kind:
        _bad(where, at, value, "an object" if kind is dict else "a list")
    return value


def _bad(where: str, at: str, value: Any, wanted: str) -> None:
    got = "missing" if value is None else f"{shown(value)[:60]} ({type(value).__name__})"
    raise MergeError(f"{where}: entry {at} is {got}, not {wanted}; {_FIX}")


def _path(name: str, at: str, where: str) -> None:
    """`name` is a plain relative path inside the directory."""
    if "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in name.split("/")):
        raise MergeError(
            f"{where}: entry {at} names a path outside the directory; refusing to read it ({_FIX})"
        )
