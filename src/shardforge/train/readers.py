"""Local data files -> rows: the readers of each file format, and `split` slices.

    data_files(ds, key)    (file, ds_type) of a data set entry (a file, or a folder's files)
    read_rows(ds, key)     the rows of one entry (all its files, in name order), sliced by split

A problem names the entry's key (`datasets[0].path`, `.ds_type`, `.split`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardforge.config.schema import DatasetConfig
from shardforge.errors import ConfigError, ShardforgeError

# file extension -> ds_type
EXTENSIONS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}

Row = dict[str, Any]


def _read_json(path: Path) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from json.loads(text)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ShardforgeError(f"{path}:{number}: invalid JSON line ({exc.msg})") from None


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _read_text(path: Path) -> Iterator[Row]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            yield {"text": line}


READERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    "json": _read_json,
    "parquet": _read_parquet,
    "text": _read_text,
}


def data_files(ds: DatasetConfig, key: str) -> list[tuple[Path, str]]:
    """(file, ds_type) of a data set entry; a missing path or unknown format names `key`."""
    path = Path(ds.path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in EXTENSIONS and p.is_file())
        if not files:
            raise ConfigError(
                f"{key}.path", [f"directory {path} holds no {'/'.join(EXTENSIONS)} files"]
            )
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"{key}.path", [f"data file {path} not found; check the path"])
    out = []
    for file in files:
        ds_type = ds.ds_type or EXTENSIONS.get(file.suffix)
        if ds_type is None:
            raise ConfigError(
                f"{key}.ds_type",
                [f"cannot infer the format of {file}; set ds_type (json, parquet or text)"],
            )
        out.append((file, ds_type))
    return out


def _split_ranges(split: str, n: int, key: str) -> list[tuple[int, int]]:
    """(start, stop) row ranges of `split` (train, train[:20%], train[10:200], ...) over n rows.

    A local file is the split `train`; the slice syntax is that of `datasets`, whose
    ReadInstruction resolves it (percent rounding included).
    """
    if split == "train":
        return [(0, n)]
    from datasets import ReadInstruction

    try:
        parts = ReadInstruction.from_spec(split).to_absolute({"train": n})
    except (ValueError, AssertionError) as exc:
        raise ConfigError(
            f"{key}.split",
            [
                f"{split!r}: {exc}; a local file is the split `train`, sliced like train[:20%], "
                "train[10:200] or train[50%:]"
            ],
        ) from None
    return [(part.from_, part.to) for part in parts]


def read_rows(ds: DatasetConfig, key: str) -> list[Row]:
    """The rows of one data set entry (all its files, in name order), sliced by `split`."""
    rows = [row for file, ds_type in data_files(ds, key) for row in READERS[ds_type](file)]
    if ds.split == "train":
        return rows
    return [
        row for start, stop in _split_ranges(ds.split, len(rows), key) for row in rows[start:stop]
    ]
