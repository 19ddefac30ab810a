"""Comparing two merge outputs: by their files' bytes, and of the integrity manifest
(`shardforge-manifest.json`) by the files it lists, since its `source` says where the
checkpoint was read from (a copy, a mirror of an s3:// prefix) and its checksum covers that."""

from __future__ import annotations

import json
from pathlib import Path

from shardforge.sinks.manifest import MANIFEST


def output_files(root: Path) -> dict[str, bytes]:
    """Every file below `root` by relative name (the manifest: the files it lists)."""
    out = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    if MANIFEST in out:
        out[MANIFEST] = json.dumps(json.loads(out[MANIFEST])["files"], sort_keys=True).encode()
    return out
