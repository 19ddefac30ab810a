"""`shardforge verify DIR [--checkpoint PATH]`: check a merged directory against the integrity
manifest its merge wrote (`shardforge-manifest.json`, `sinks.manifest`), and with
`--checkpoint` the checkpoint it was merged from against the identity recorded there.

This reader shares nothing with the writer: each file is hashed here as it is read, with the
`blake3` package (a local file mapped and hashed on every core: several GB/s) or `hashlib`'s
SHA-256, as the manifest's version and `hash` say (`verify_manifest.hash_of`); each source record is opened with Python's `zipfile` (not shardforge's zip locator), its
stored CRC-32s compared with the manifest's and its members' bytes with them (`testzip`). Files
are read through fsspec: a local path through its local file system, an ``s3://`` URI through
s3fs's own buffered files (not the merge's ranged reads or uploads; credentials and endpoint
from the AWS variables). The first problem is one `error:` line naming the file; exit 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from shardforge.cli import verify_manifest
from shardforge.cli._common import fire_entry, shardforge_command
from shardforge.errors import MergeError
from shardforge.io.files import inside
from shardforge.io.remote import RemoteURI, filesystem, is_remote, storage_errors
from shardforge.layouts.catalog import recorded_checkpoint
from shardforge.sinks.manifest import MANIFEST

EPILOG = """\b
Examples:
  # every file of a merged model against its shardforge-manifest.json
  shardforge verify outputs/merged
  # and the checkpoint it was merged from (sizes, records' CRC-32s, their bytes): the run
  # folder, the step folder or the model folder (the step the manifest names)
  shardforge verify outputs/merged --checkpoint outputs/run
  shardforge verify outputs/merged --checkpoint outputs/run/checkpoint-500/pytorch_model_fsdp_0
  # a model merged to object storage (credentials from the AWS variables)
  shardforge verify s3://models/run-7 --checkpoint s3://ckpts/run-7/checkpoint-500/model
  python -m shardforge.cli.verify outputs/merged
"""

BLOCK = 8 << 20  # bytes hashed at a time


@dataclass(frozen=True)
class Location:
    """A file or folder to check, local or in object storage."""

    fs: Any  # an fsspec file system
    path: str  # its path there
    shown: str  # how messages name it

    @classmethod
    def of(cls, text: str | Path) -> Location:
        if is_remote(str(text)):
            uri = RemoteURI.parse(str(text))
            # a client of its own: no listing or session cached by an earlier use
            fs = filesystem({"skip_instance_cache": True})
            return cls(fs, uri.path, str(uri))
        import fsspec

        return cls(fsspec.filesystem("file"), os.path.abspath(text), str(text))

    def child(self, name: str) -> Location:
        return Location(self.fs, f"{self.path}/{name}", f"{self.shown}/{name}")

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.path))

    def size(self) -> int:
        return int(self.fs.size(self.path))

    def open(self) -> Any:
        return self.fs.open(self.path, "rb")

    def holds(self, path: Location) -> bool:
        """`path` (a child) lies inside this folder: on a local disk with symlinks resolved
        (`io.files.inside`); in a store its name was checked (`verify_manifest`)."""
        return is_remote(self.shown) or inside(Path(path.path), Path(self.path))

    def names(self) -> list[str]:
        """Every file below this folder, by its path relative to it."""
        prefix = self.path.rstrip("/") + "/"
        return sorted(p[len(prefix) :] for p in self.fs.find(self.path) if p.startswith(prefix))


def _fail(where: Location, problem: str, details: list[str] | None = None) -> MergeError:
    return MergeError(f"{where.shown}: {problem}", details or [])


def read_manifest(directory: Location) -> dict[str, Any]:
    """The manifest of `directory`, read as untrusted input (`cli.verify_manifest`: size,
    nesting, schema, paths) and checked to be unchanged since it was written."""
    path = directory.child(MANIFEST)
    if not directory.is_dir():
        raise _fail(directory, "not a directory; give a merged model directory")
    if not path.is_file():
        raise _fail(path, "missing; was this directory written by a shardforge merge?")
    limit = verify_manifest.MAX_MANIFEST_BYTES
    if (size := path.size()) > limit:
        raise verify_manifest.too_large(path.shown, size)  # nothing read
    try:
        with path.open() as f:
            data = f.read(limit + 1)  # no more, even if it grew meanwhile
    except OSError as exc:
        raise _fail(path, f"not readable ({type(exc).__name__})") from None
    return verify_manifest.parse_manifest(data, path.shown)


def _inside(folder: Location, path: Location) -> None:
    if not folder.holds(path):
        raise _fail(path, f"resolves outside {folder.shown} (a symlink); refusing to read it")


def sha256_of(path: Location) -> str:
    return digest_of(path, "sha256")


def digest_of(path: Location, algo: str) -> str:
    """The `algo` digest of the file at `path` ("blake3" or "sha256")."""
    if algo == "blake3":
        import blake3
        from fsspec.implementations.local import LocalFileSystem

        h: Any = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if isinstance(path.fs, LocalFileSystem):  # mapped, hashed on every core
            return str(h.update_mmap(path.path).hexdigest())
    else:
        h = hashlib.sha256()
    with path.open() as f:
        while block := f.read(BLOCK):
            h.update(block)
    return str(h.hexdigest())


def check_files(directory: Location, files: dict[str, Any], algo: str = "sha256") -> int:
    """Every listed file present with its size and `algo` digest, and no other file; the
    bytes checked."""
    total = 0
    for name in sorted(files):
        want, path = files[name], directory.child(name)
        _inside(directory, path)
        if not path.is_file():
            raise _fail(path, f"missing (listed in {MANIFEST})")
        size = path.size()
        if size != want.get("size"):
            raise _fail(path, f"{size:,} bytes, {want.get('size'):,} when it was written")
        got = digest_of(path, algo)
        if got != want.get(algo):
            detail = [f"written: {want.get(algo)}", f"now:     {got}"]
            name = {"sha256": "SHA-256", "blake3": "BLAKE3"}[algo]
            raise _fail(path, f"{name} differs from the manifest (the file changed)", detail)
        total += size
    listed = {*files, MANIFEST}
    for name in directory.names():
        if name not in listed:
            raise _fail(directory.child(name), f"not written by the merge (not in {MANIFEST})")
    return total


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own (a DCP chunk's
    zip archive for `zipfile`)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _check_record(f: Any, path: Location, record: dict[str, Any]) -> None:
    at = f"record at byte {record['offset']}"
    try:
        with zipfile.ZipFile(_Window(f, record["offset"], record["length"])) as z:
            stored = {m: z.getinfo(m).CRC for m in record["crc32"]}
            bad = z.testzip()
    except (zipfile.BadZipFile, KeyError, OSError, ValueError) as exc:
        raise _fail(path, f"{at}: not the record merged ({type(exc).__name__})") from None
    for member, crc in record["crc32"].items():
        if stored[member] != crc:
            raise _fail(path, f"{at}: {member} was rewritten (stored CRC-32 differs)")
    if bad is not None:
        raise _fail(path, f"{at}: the bytes of {bad} do not match their CRC-32 (changed)")


def check_source(source: dict[str, Any], root: Location) -> int:
    """The checkpoint at `root` against one source entry of the manifest: every file present
    with its size, records and SHA-256; the number of records checked."""
    records = 0
    folder = root.is_dir()
    for entry in source.get("files", []):
        path = root.child(entry["path"]) if folder else root
        _inside(root, path)
        if not path.is_file():
            raise _fail(path, "missing from the checkpoint the output was merged from")
        size = path.size()
        if size != entry["size"]:
            raise _fail(path, f"{size:,} bytes, {entry['size']:,} when it was merged")
        if "sha256" in entry and sha256_of(path) != entry["sha256"]:
            raise _fail(path, "SHA-256 differs from when it was merged (the file changed)")
        with path.open() as f:
            for record in entry.get("records", []):
                _check_record(f, path, record)
                records += 1
    return records


def _source_for(doc: dict[str, Any], checkpoint: Location) -> dict[str, Any]:
    """The manifest's source entry `checkpoint` stands for: the one whose location it is, or
    the only one (a checkpoint moved since)."""
    sources = doc["source"]
    here = checkpoint.shown if is_remote(checkpoint.shown) else checkpoint.path
    found = [s for s in sources if str(s.get("location", "")).rstrip("/") == here.rstrip("/")]
    if found:
        return dict(found[0])
    if len(sources) == 1:
        return dict(sources[0])
    where = [str(s.get("location")) for s in sources]
    raise _fail(checkpoint, f"not one of the {len(sources)} checkpoints merged", where)


def _step_merged(doc: dict[str, Any], checkpoint: Location) -> Location:
    """A local run folder, step folder or model folder as the checkpoint the manifest's one
    source names (its step, found as the merge finds it: `layouts.catalog`); another step is an
    error saying which one was merged."""
    sources = doc["source"]
    if is_remote(checkpoint.shown) or len(sources) != 1:
        return checkpoint
    found = recorded_checkpoint(Path(checkpoint.path), str(sources[0].get("location", "")))
    return checkpoint if str(found) == checkpoint.path else Location.of(found)


def _requests(where: str | Path) -> contextlib.AbstractContextManager[None]:
    """A failed request to the store of an s3:// `where`: one line saying what to do."""
    return storage_errors(where) if is_remote(str(where)) else contextlib.nullcontext()


def do_verify(directory: str | Path, checkpoint: str | Path | None = None) -> str:
    """What `shardforge verify` prints once every check passed (else a MergeError)."""
    with _requests(directory):  # an unreachable store or a refused request: one line
        out = Location.of(directory)
        doc = read_manifest(out)
        total = check_files(out, doc["files"], verify_manifest.hash_of(doc))
    lines = [f"ok: {out.shown}: {len(doc['files'])} files, {total:,} bytes as written ({MANIFEST})"]
    if checkpoint is not None:
        with _requests(checkpoint):
            ckpt = _step_merged(doc, Location.of(checkpoint))
            source = _source_for(doc, ckpt)
            records = check_source(source, ckpt)
        files = len(source.get("files", []))
        lines.append(f"ok: {ckpt.shown}: {files} files, {records} records as merged")
    return "\n".join(lines) + "\n"


@shardforge_command(
    "verify",
    epilog=EPILOG,
    overrides=False,
    params=[
        click.Argument(["directory"], metavar="DIR"),
        click.Option(
            ["--checkpoint"],
            metavar="PATH",
            help="Also check this checkpoint (the one merged, possibly moved since) against "
            "the identity the manifest records: files, sizes, records' CRC-32s and bytes. A "
            "run folder, a step folder or the model folder, as merge and inspect take them: "
            "the step the manifest names is checked.",
        ),
    ],
)
def command(directory: str, checkpoint: str | None) -> str:
    """Check a directory a shardforge merge wrote against its shardforge-manifest.json: every
    file present, none added, each with the size and SHA-256 it was written with (and the
    manifest itself unchanged). With --checkpoint, the checkpoint it was merged from: its
    files and sizes, and every record's stored CRC-32 and bytes. Reads every byte once;
    writes nothing. Exit 0 when all match, 1 naming the first file that does not."""
    return do_verify(directory, checkpoint)


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
