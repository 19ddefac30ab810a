"""Prepared data sets: tokenized, templated, masked and packed once into `dataset_prepared_path`,
then reused by every run whose inputs hash the same (`shardforge preprocess`, `train`).

    prepare(cfg, tokenizer, root)           one process: reuse root/<hash>, or build and write it
    prepared_datasets(cfg, tokenizer, rt)   train's data sets: through the prepared folder when
                                            dataset_prepared_path is set, else built in memory
    problem(folder)                         what is wrong with a prepared folder (None: nothing)

A prepared folder `root/<hash>` (the hash of `prepared_key.key_inputs`) holds the training and
evaluation sequences as a `datasets` DatasetDict (`save_to_disk`: train/, eval/; one fixed-size
int64 list column per tensor) and manifest.json: the format, the hash and the inputs it was
computed from, the evaluation key and the size and sha256 of every other file. It is written into
a hidden temporary sibling and renamed into place (`io.publish.atomic_directory`): a folder is
complete or absent. One that fails `problem` (a file missing, truncated or changed, a foreign
manifest) is never read: it is prepared again, with a warning. Several configs can share one
`dataset_prepared_path`: each hash has its own folder; when none matches, the reason given is
what changed since the newest folder there.

On several ranks, local rank 0 of each node prepares, under a file lock (root/.<hash>.lock) that
makes the nodes of a shared file system take turns (the first builds, the others find its folder);
the other ranks wait for their node's in an all-gather of the folders, then read it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError, MergeError, ShardforgeError, shown
from shardforge.io.publish import atomic_directory
from shardforge.train.data import Sequences
from shardforge.train.eval import Datasets, build_datasets
from shardforge.train.prepared_key import (
    FORMAT_VERSION,
    changes,
    digest,
    file_sha256,
    key_inputs,
)
from shardforge.train.runtime import Runtime

log = logging.getLogger("shardforge")

MANIFEST = "manifest.json"
FORMAT_NAME = "shardforge-prepared-data"
# the tensors of `Sequences`, stored as columns of the same names (position_ids: packed only)
COLUMNS: tuple[str, ...] = ("input_ids", "labels", "attention_mask", "position_ids")
# reasons listed in the notice of a rebuild; the rest are counted
MAX_REASONS = 4
# errors of a file lock the file system does not offer (then the nodes may build side by side)
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
# errors of a lock file in a folder this process may read but not write
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


@dataclass(frozen=True)
class Prepared:
    """A prepared folder and its data sets; `built`: prepared now (False: an existing one)."""

    folder: Path
    hash: str
    data: Datasets
    built: bool


# ---------------------------------------------------------------------------------------------
# checking and reading a prepared folder


def _manifest(folder: Path) -> dict[str, Any] | str:
    """The folder's manifest, or what is wrong with it."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        return f"{MANIFEST} is not a shardforge prepared-data manifest"
    if data.get("format_version") != FORMAT_VERSION:
        return f"format version {shown(data.get('format_version'))}, not {FORMAT_VERSION}"
    if data.get("hash") != folder.name:
        return f"it holds the data of hash {shown(data.get('hash'))}, not {folder.name}"
    return data


def _file_problem(folder: Path, name: str, entry: Any, checksums: bool) -> str | None:
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return f"{MANIFEST} names a file outside the folder: {shown(name)}"
    if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)):
        return f"{MANIFEST}'s entry of {name} is malformed"
    path = folder / relative
    if not path.is_file():
        return f"{name} is missing"
    size, expected = path.stat().st_size, entry["size"]
    if size != expected:
        cut = " (truncated)" if size < expected else ""
        return f"{name} has {size} bytes, {expected} expected{cut}"
    if checksums and file_sha256(path) != entry.get("sha256"):
        return f"{name} does not match its sha256 (its contents changed)"
    return None


def problem(folder: Path, checksums: bool = True) -> str | None:
    """What is wrong with the prepared folder `folder` (None: nothing): its manifest, and every
    file it lists (present, its size; with `checksums` its sha256 too)."""
    manifest = _manifest(folder)
    if isinstance(manifest, str):
        return manifest
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    for name, entry in sorted(files.items()):
        found = _file_problem(folder, str(name), entry, checksums)
        if found is not None:
            return found
    return None


def _column(split: Any, name: str) -> torch.Tensor:
    """A fixed-size list column as an [N, width] int64 tensor (copied out of the mapped file)."""
    column = split.data.column(name).combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(values.copy()).reshape(-1, column.type.list_size)


def _sequences(split: Any) -> Sequences:
    tensors = {name: _column(split, name) for name in COLUMNS if name in split.column_names}
    return Sequences(**tensors)


def read(folder: Path) -> Datasets:
    """The data sets of a prepared folder (check it with `problem` first)."""
    import datasets

    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    loaded = datasets.load_from_disk(str(folder))
    evals = _sequences(loaded["eval"]) if "eval" in loaded else None
    return Datasets(_sequences(loaded["train"]), evals, str(manifest.get("eval_key", "")))


# ---------------------------------------------------------------------------------------------
# writing a prepared folder


def _table(seqs: Sequences) -> Any:
    import pyarrow as pa

    width = int(seqs.input_ids.shape[1])
    columns = {}
    for name in COLUMNS:
        tensor = getattr(seqs, name)
        if tensor is not None:
            flat = pa.array(tensor.to(torch.int64).reshape(-1).numpy())
            columns[name] = pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.table(columns)


def _save_splits(folder: Path, data: Datasets) -> None:
    """train/ (and eval/) with `datasets`' save_to_disk."""
    import datasets
    from datasets.table import InMemoryTable

    splits = {"train": data.train, **({"eval": data.eval} if data.eval is not None else {})}
    # a fingerprint of our own: datasets would otherwise hash every row to make one
    ready = datasets.DatasetDict(
        {
            name: datasets.Dataset(InMemoryTable(_table(seqs)), fingerprint=f"{folder.name}-{name}")
            for name, seqs in splits.items()
        }
    )
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        ready.save_to_disk(str(folder))
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _manifest_of(tmp: Path, name: str, data: Datasets, inputs: dict[str, Any]) -> dict[str, Any]:
    files = {
        p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    splits = {"train": data.train, "eval": data.eval}
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "hash": name,
        "created": time.time(),
        "eval_key": data.eval_key,
        "sequences": {k: len(v) for k, v in splits.items() if v is not None},
        "inputs": inputs,
        "files": files,
    }


def _write(folder: Path, data: Datasets, inputs: dict[str, Any]) -> None:
    """Write the prepared folder atomically. One already there is replaced: it is damaged, or
    was written meanwhile by a process that could not take the lock (its contents are these)."""
    try:
        with atomic_directory(folder, overwrite=True) as tmp:
            _save_splits(tmp, data)
            manifest = _manifest_of(tmp, folder.name, data, inputs)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    except MergeError as exc:
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else exc.message
        raise ConfigError(
            "dataset_prepared_path",
            [
                f"cannot write the prepared data sets to {folder} ({reason}); free space or "
                "choose another folder"
            ],
        ) from exc


# ---------------------------------------------------------------------------------------------
# one process: reuse or prepare


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """Hold root/.<name>.lock exclusively (waiting for another process that holds it). In a
    folder this process cannot write, go on without it: an intact prepared folder is read."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "dataset_prepared_path",
            [f"cannot create {root} ({exc.strerror or exc}); choose a writable folder"],
        ) from None
    try:
        lock = (root / f".{name}.lock").open("a")
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish preparing %s", root / name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise
            log.info("%s: no file locks on this file system; preparing without one", root)
        yield


def _newest_other(root: Path, name: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest other prepared folder in `root` and its inputs (None: there is none)."""
    found: list[tuple[float, Path, dict[str, Any]]] = []
    for folder in root.iterdir():
        if folder.name == name or folder.name.startswith(".") or not folder.is_dir():
            continue
        manifest = _manifest(folder)
        if isinstance(manifest, dict) and isinstance(manifest.get("inputs"), dict):
            created = manifest.get("created")
            when = float(created) if isinstance(created, int | float) else 0.0
            found.append((when, folder, manifest["inputs"]))
    if not found:
        return None
    _when, folder, inputs = max(found, key=lambda item: item[0])
    return folder, inputs


def _why(root: Path, name: str, inputs: dict[str, Any]) -> str:
    """The notice of a build: what changed since the newest prepared folder in `root`."""
    other = _newest_other(root, name)
    if other is None:
        return f"preparing the data sets into {root / name} (hash {name}): none prepared yet"
    reasons = changes(other[1], inputs) or ["the inputs differ"]
    more = f" (+{len(reasons) - MAX_REASONS} more)" if len(reasons) > MAX_REASONS else ""
    return (
        f"preparing the data sets into {root / name} (hash {name}), as inputs changed since "
        f"{other[0]}: {'; '.join(reasons[:MAX_REASONS])}{more}"
    )


def _reuse(folder: Path) -> Datasets | str:
    """The data sets of an existing folder, or what is wrong with it."""
    wrong = problem(folder)
    if wrong is not None:
        return wrong
    try:
        return read(folder)
    except Exception as exc:  # files that match their checksums but do not load
        return f"it does not load ({type(exc).__name__}: {shown(str(exc), 120)})"


def summary(data: Datasets) -> str:
    """'84 training sequences of 32 tokens, 4 evaluation sequences (val_set_size)'."""
    text = f"{len(data.train)} training sequences of {data.train.input_ids.shape[1]} tokens"
    if data.eval is not None:
        text += f", {len(data.eval)} evaluation sequences ({data.eval_key})"
    return text


def prepare(cfg: ShardforgeConfig, tokenizer: Any, root: Path, report: bool = True) -> Prepared:
    """Reuse root/<hash> when it is intact, else build the data sets and write it (saying why).

    `tokenizer` is the one `load_tokenizer(cfg)` returns. Holds the folder's lock throughout, so
    two processes on one file system never both build it. `report`: log which folder was used
    or written (False: the caller prints the outcome itself, as `preprocess` does)."""
    inputs = key_inputs(cfg, tokenizer)
    name = digest(inputs)
    folder = root / name
    with _locked(root, name):
        if folder.exists():
            reused = _reuse(folder)
            if isinstance(reused, Datasets):
                if report:
                    log.info("using prepared dataset at %s (hash %s)", folder, name)
                return Prepared(folder, name, reused, built=False)
            log.warning(
                "warning: the prepared dataset at %s is damaged (%s); preparing it again",
                folder,
                reused,
            )
        else:
            log.info("%s", _why(root, name, inputs))
        data = build_datasets(cfg, tokenizer)
        _write(folder, data, inputs)
    if report:
        log.info("prepared dataset written to %s: %s", folder, summary(data))
    return Prepared(folder, name, data, built=True)


# ---------------------------------------------------------------------------------------------
# several ranks: one process per node prepares


def _portable(exc: BaseException) -> ShardforgeError:
    """What a node's other ranks raise when its local rank 0 failed with `exc`."""
    if isinstance(exc, ShardforgeError):
        return exc
    return ShardforgeError(
        f"dataset_prepared_path: preparing the data sets failed on this node's local rank 0 "
        f"({type(exc).__name__}: {shown(str(exc), 120)})"
    )


def _node_copy(folder: Path) -> Datasets:
    """A non-leader's read of its node's folder (its local rank 0 has just checked the sums)."""
    wrong = problem(folder, checksums=False)
    if wrong is not None:
        raise ShardforgeError(
            f"dataset_prepared_path: {folder} changed after it was prepared ({wrong}); "
            "is another job writing it? Run again"
        )
    return read(folder)


def prepared_datasets(cfg: ShardforgeConfig, tokenizer: Any, rt: Runtime) -> Datasets:
    """The training (and evaluation) sequences of `cfg`: built in memory without
    dataset_prepared_path; else its folder for these inputs, reused or prepared by local rank 0
    of each node while the node's other ranks wait, then read by them."""
    if cfg.dataset_prepared_path is None:
        return build_datasets(cfg, tokenizer)
    root = Path(cfg.dataset_prepared_path)
    if rt.world_size == 1:
        return prepare(cfg, tokenizer, root).data
    outcome: Prepared | BaseException | None = None
    if rt.local_rank == 0:
        try:
            outcome = prepare(cfg, tokenizer, root)
        except Exception as exc:  # the node's other ranks must not wait for nothing
            outcome = exc
    sent = str(outcome.folder) if isinstance(outcome, Prepared) else outcome
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, _portable(sent) if isinstance(sent, BaseException) else sent)
    if isinstance(outcome, BaseException):
        raise outcome
    if isinstance(outcome, Prepared):
        return outcome.data
    leader = gathered[rt.rank - rt.local_rank]  # torchrun numbers a node's ranks consecutively
    if isinstance(leader, ShardforgeError):
        raise leader
    return _node_copy(Path(leader))
