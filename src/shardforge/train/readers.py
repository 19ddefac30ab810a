"""Local data files -> rows: the readers of each file format, and `split` slices.

    data_files(ds, key)    (file, ds_type) of a data set entry (a file, a folder's files, its
                           `data_files`, or the files of its `name`d configuration)
    read_rows(ds, key)     the rows of one entry (all its files, in name order), sliced by
                           split, then its `shards` shard

A problem names the entry's key (`datasets[0].path`, `.ds_type`, `.split`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardforge.config.schema import DatasetConfig
from shardforge.config.schema_data import PretrainingDataset
from shardforge.errors import ConfigError, ShardforgeError, shown

# file extension -> ds_type
EXTENSIONS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}

Row = dict[str, Any]


def _first_char(path: Path) -> str:
    """The first character of a text file that is not white space ("" if none)."""
    with path.open(encoding="utf-8") as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip():
                return stripped[0]
    return ""


def _read_json(path: Path) -> Iterator[Row]:
    """A JSON array (read whole) or JSON lines (read one line at a time)."""
    if _first_char(path) == "[":
        yield from json.loads(path.read_text(encoding="utf-8"))
        return
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ShardforgeError(
                        f"{path}:{number}: invalid JSON line ({exc.msg})"
                    ) from None


def _read_parquet(path: Path) -> Iterator[Row]:
    """One record batch at a time."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _read_text(path: Path) -> Iterator[Row]:
    with path.open(encoding="utf-8") as f:
        for chunk in f:
            for line in chunk.splitlines():
                if line.strip():
                    yield {"text": line}


READERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    "json": _read_json,
    "parquet": _read_parquet,
    "text": _read_text,
}


def _listed(folder: Path, names: str | list[str], key: str) -> list[Path]:
    """Files named relative to `folder` (or absolute), each a file that exists."""
    out = []
    for name in [names] if isinstance(names, str) else names:
        file = folder / name
        if not file.is_file():
            raise ConfigError(key, [f"{shown(str(file), 200)} is not a file; check the name"])
        out.append(file)
    return out


def _readme_configs(folder: Path) -> list[Any]:
    """The `configs:` list of the YAML header of a data set folder's README.md (Hub layout)."""
    readme = folder / "README.md"
    if not readme.is_file():
        return []
    import yaml

    text = readme.read_text(encoding="utf-8")
    if not text.startswith("---"):
        return []
    header = text.split("---", 2)[1] if text.count("---") >= 2 else ""
    try:
        meta = yaml.safe_load(header) or {}
    except yaml.YAMLError:
        return []
    configs = meta.get("configs") if isinstance(meta, dict) else None
    return configs if isinstance(configs, list) else []


def _config_files(folder: Path, name: str, key: str) -> list[Path]:
    """The train files of the configuration `name` of a local data set folder."""
    configs = _readme_configs(folder)
    for config in configs:
        if isinstance(config, dict) and config.get("config_name") == name:
            spec = config.get("data_files")
            if isinstance(spec, list) and spec and isinstance(spec[0], dict):
                spec = [p for d in spec if d.get("split", "train") == "train" for p in _paths(d)]
            if isinstance(spec, dict):
                spec = _paths(spec)
            if isinstance(spec, str | list) and spec:
                return sorted({f for pattern in _as_list(spec) for f in folder.glob(pattern)})
    names = [c.get("config_name") for c in configs if isinstance(c, dict)]
    known = f"its configurations: {', '.join(map(str, names))}" if names else "it has none"
    raise ConfigError(
        f"{key}.name",
        [
            f"{name!r} is not a configuration of {folder} ({known}, from the `configs:` of its "
            "README.md); Hub data sets are not downloaded: save it locally and set path"
        ],
    )


# what a Hub data set id looks like (`tatsu-lab/alpaca`): owner/name, no file extension
_HUB_ID = re.compile(r"[\w.-]+/[\w-]+")


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _paths(entry: dict[str, Any]) -> list[str]:
    value = entry.get("path", [])
    return _as_list(value) if isinstance(value, str | list) else []


def _entry_files(ds: DatasetConfig | PretrainingDataset, key: str) -> list[Path]:
    path = Path(ds.path)
    if not path.exists():
        if ds.name or _HUB_ID.fullmatch(ds.path):
            why = (
                f"data file {path} not found: a Hub data set id? Hub data sets are not "
                "downloaded; save it locally (datasets.load_dataset(...).to_json('data.jsonl')) "
                "and set path to the file"
            )
            raise ConfigError(f"{key}.path", [why])
        raise ConfigError(f"{key}.path", [f"data file {path} not found; check the path"])
    if ds.name and path.is_dir():
        return _config_files(path, ds.name, key)
    if ds.data_files and path.is_dir():
        return _listed(path, ds.data_files, f"{key}.data_files")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in EXTENSIONS and p.is_file())
    if not files:
        raise ConfigError(
            f"{key}.path", [f"directory {path} holds no {'/'.join(EXTENSIONS)} files"]
        )
    return files


def data_files(ds: DatasetConfig | PretrainingDataset, key: str) -> list[tuple[Path, str]]:
    """(file, ds_type) of a data set entry; a missing path or unknown format names `key`."""
    files = _entry_files(ds, key)
    out = []
    for file in files:
        ds_type = getattr(ds, "ds_type", None) or EXTENSIONS.get(file.suffix)
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


def shard_range(n: int, shards: int, index: int) -> tuple[int, int]:
    """(start, stop) of contiguous shard `index` of n rows cut into `shards`, as `datasets`'
    Dataset.shard(contiguous=True): the first n % shards shards hold one row more."""
    size, extra = divmod(n, shards)
    start = index * size + min(index, extra)
    return start, start + size + (1 if index < extra else 0)


def seeded_permutation(n: int, seed: int) -> list[int]:
    """The order `datasets`' Dataset.shuffle(seed) gives n rows (numpy's default_rng)."""
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


def _shard(rows: list[Row], ds: DatasetConfig, seed: int, key: str) -> list[Row]:
    """`shards` / `shards_idx`: the rows shuffled with seed, then one contiguous shard."""
    if not ds.shards:
        return rows
    index = ds.shards_idx or 0
    if index >= ds.shards:
        raise ConfigError(f"{key}.shards_idx", [f"{index} is not below shards ({ds.shards})"])
    order = seeded_permutation(len(rows), seed)
    start, stop = shard_range(len(rows), ds.shards, index)
    return [rows[i] for i in order[start:stop]]


def read_rows(ds: DatasetConfig, key: str, seed: int = 42) -> list[Row]:
    """The rows of one data set entry (all its files, in name order), sliced by `split`, then
    its shard (`shards`, shuffled with `seed`)."""
    rows = [row for file, ds_type in data_files(ds, key) for row in READERS[ds_type](file)]
    if ds.split != "train":
        rows = [
            row
            for start, stop in _split_ranges(ds.split, len(rows), key)
            for row in rows[start:stop]
        ]
    return _shard(rows, ds, seed, key)
