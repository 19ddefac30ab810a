"""The integrity manifest every output directory carries: ``shardforge-manifest.json``.

    {"format": "shardforge-manifest", "version": 2, "hash": "blake3",
     "written_by": "shardforge 0.1.0",
     "files": {"model.safetensors": {"size": 4000000000, "blake3": "9f2c..."}, ...},
     "source": [{"location": "/runs/a/checkpoint-500/pytorch_model_fsdp_0", "format": "dcp",
                 "files": [{"path": "__0_0.distcp", "size": 2000000000,
                            "records": [{"offset": 0, "length": 8392000,
                                         "crc32": {"0/data/0": 2891173640}}, ...]}, ...]}]}

`files` lists every file of the directory but the manifest itself, with its digest under the
name of the manifest's `hash`: BLAKE3 by default (what `b3sum` prints), SHA-256 with
`--manifest_hash sha256` (what the Hub lists). Version 1 (every manifest before BLAKE3) had no
`hash` and SHA-256 digests; `shardforge verify` reads both. The weights are hashed from their
written bytes as the copy goes (`safetensors_files.write_plan` with `hashes`:
`io.digest.FileHash`, from the windows `io.direct` writes); the small files beside them (config,
generation config, tokenizer, index, adapter config: written by transformers or as JSON) are
hashed here once written. `source` is what the merge read (`CheckpointFormat.identity`): each checkpoint
location, its files and sizes, and the CRC-32 its writer stored for each record where the
format has them (the SHA-256 of a small file without records, such as `.metadata`).
`checksum` is the SHA-256 of the rest of the manifest (`canonical`): an edited manifest is
told from a changed file. The manifest is the last file written into the hidden directory before it is
published (`io.publish.atomic_directory`), so a published directory always has one.
`shardforge verify DIR` checks a directory against it with its own reader (`cli.verify`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardforge.formats.base import SourceFile, TensorSource
from shardforge.formats.registry import format_named
from shardforge.io.digest import DEFAULT, Digests, hash_file
from shardforge.io.mirror import public_name
from shardforge.io.model_files import MERGE_MANIFEST
from shardforge.version import __version__

MANIFEST = MERGE_MANIFEST
MANIFEST_FORMAT = "shardforge-manifest"
MANIFEST_VERSION = 2  # 1: SHA-256 digests, no `hash` (read by `verify` still)
# Turned off, no manifest is written and nothing is hashed (benchmarks/merge_bench.py's
# `shardforge_nomanifest` measures what the manifest costs).
ENABLED = True
# bytes read at a time when a small file is hashed once written
READ_BLOCK = 1 << 20
# a source file without records up to this size is identified by its SHA-256 (a `.metadata`)
SMALL_SOURCE = 16 << 20


def new_hashes(algo: str = DEFAULT) -> Digests | None:
    """Where a writer puts each file's `algo` hash as it writes it (None: no manifest)."""
    return Digests(algo) if ENABLED else None


def write_manifest(
    directory: Path,
    hashes: Digests | None,
    sources: Iterable[TensorSource] = (),
    elsewhere: Mapping[str, int] | None = None,
) -> None:
    """Write the manifest of `directory` (every other file in it; `hashes`: the hashes of
    those hashed as they were written, or their digest already known; the identity of what
    `sources` were read from); nothing when `hashes` is None (`ENABLED` off). `elsewhere`:
    files of the output that are not in `directory` (name -> size; uploaded already), with
    their hash in `hashes`."""
    if hashes is None:
        return
    sizes = {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    sizes.update(elsewhere or {})
    algo = hashes.algo
    files: dict[str, dict[str, Any]] = {}
    for name, size in sorted(sizes.items()):
        known = name in hashes
        digest = hashes.digest(name, size) if known else hash_file(directory / name, algo)
        files[name] = {"size": size, algo: digest}
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "hash": algo,
        "written_by": f"shardforge {__version__}",
        "files": files,
        "source": source_identity(sources),
    }
    doc["checksum"] = hashlib.sha256(canonical(doc)).hexdigest()
    (directory / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes the manifest's own `checksum` is the SHA-256 of: the document without it,
    keys sorted, no spaces (an edit to the manifest changes them)."""
    rest = {k: v for k, v in doc.items() if k != "checksum"}
    return json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()


def hash_files(directory: Path, names: Iterable[str], algo: str) -> dict[str, str]:
    """The `algo` digest of files already written (a merge on several ranks: one file's bytes
    come from several processes, and neither hash is made of parts)."""
    return {name: hash_file(directory / name, algo) for name in names}


def _hash_file(path: Path) -> str:
    """The SHA-256 of a small source file without records (a `.metadata`, an index)."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(READ_BLOCK):
            sha.update(block)
    return sha.hexdigest()


def _locations(sources: Iterable[TensorSource]) -> list[tuple[str, Path]]:
    """Each (format, location) the sources' stored tensors come from, in a stable order."""
    return sorted({(s.fmt, s.directory.absolute()) for src in sources for s in src.stored()})


def source_identity(sources: Iterable[TensorSource]) -> list[dict[str, Any]]:
    """Each location the sources' stored tensors come from (`TensorSource.stored`), as its
    format describes it (`CheckpointFormat.identity`), in a stable order."""
    return [  # a checkpoint in object storage under its URI, not its local mirror's path
        {
            "location": public_name(str(location)),
            "format": fmt,
            "files": [entry for _, entry in _files(fmt, location)],
        }
        for fmt, location in _locations(sources)
    ]


def source_files(sources: Iterable[TensorSource]) -> list[tuple[Path, dict[str, Any]]]:
    """Every file the sources are read from: its local path and its entry in the manifest
    (size, records' CRC-32s or a small file's SHA-256)."""
    return [found for fmt, location in _locations(sources) for found in _files(fmt, location)]


def _files(fmt: str, location: Path) -> list[tuple[Path, dict[str, Any]]]:
    base = location if location.is_dir() else location.parent
    return [(base / f.path, _file(f, base / f.path)) for f in format_named(fmt).identity(location)]


def _file(f: SourceFile, path: Path) -> dict[str, Any]:
    """A source file's entry: its records' stored CRC-32s, or for a small file without
    records (a `.metadata`, an index) its SHA-256."""
    out: dict[str, Any] = {"path": f.path.as_posix(), "size": f.size}
    if f.records:
        out["records"] = [
            {"offset": r.offset, "length": r.length, "crc32": dict(r.crc32)} for r in f.records
        ]
    elif f.size <= SMALL_SOURCE:
        out["sha256"] = _hash_file(path)
    return out
