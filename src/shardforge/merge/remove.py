"""`--remove_checkpoint_dir`: delete exactly the model shard files the merge read, nothing else.

    plan = plan_removal(candidate, root)   # before merging: refuses what it must not delete
    ...                                     # merge, verify, publish
    removed = remove_shards(plan)          # after a verification that passed

What the shard files are comes from the format's row (`CheckpointFormat.shard_files`); the
layout's row says whether optimizer or trainer state shares those files. A DCP
directory's shards are its `.metadata` and the data files its entries name; when any entry is
optimizer or other training state (torchtitan `step-N/`, Lightning `.ckpt/`, a DCP saved with
model and optimizer together) removal is refused before anything is written. Rank-file folders
lose only their `model_world_size_W_rank_R.pt` files. The model folder goes only when nothing
else is left in it.

Nothing is deleted through a symbolic link: a link anywhere from the checkpoint path given down
to a shard refuses removal (before merging), and the deletion itself walks the folders with
`O_NOFOLLOW` and checks that each file is still the one that was read (device, inode, size,
modification time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePath

from shardforge.errors import MergeError
from shardforge.formats.base import NOT_REMOVED
from shardforge.formats.registry import format_named
from shardforge.layouts.catalog import state_of
from shardforge.layouts.layout import Candidate

log = logging.getLogger("shardforge")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# entries listed when the model folder is kept
MAX_LISTED = 5


@dataclass(frozen=True)
class ShardFile:
    """A shard file (relative to the model directory) and what identified it when read."""

    relative: PurePath
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


@dataclass(frozen=True)
class RemovalPlan:
    """The files `--remove_checkpoint_dir` deletes after the merge: `model_dir`'s shards,
    reached from `root` (the checkpoint path given) without a symbolic link."""

    root: Path
    model_dir: Path
    files: tuple[ShardFile, ...]


@dataclass(frozen=True)
class Removed:
    """What was removed, and whether the model folder went too (it had nothing else)."""

    files: tuple[Path, ...]
    folder_removed: bool
    kept: tuple[str, ...]  # what is left in the model folder when it stays


def _links(root: Path, model_dir: Path, files: list[PurePath]) -> list[Path]:
    """The symbolic links on the way from `root` (included) to each shard file."""
    try:
        rel = PurePath(model_dir.relative_to(root))
    except ValueError:
        root, rel = model_dir, PurePath()
    steps = [root]
    for part in rel.parts:
        steps.append(steps[-1] / part)
    for f in files:
        for i in range(1, len(f.parts) + 1):
            steps.append(model_dir.joinpath(*f.parts[:i]))
    return [p for p in dict.fromkeys(steps) if p.is_symlink()]


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def plan_removal(candidate: Candidate, root: str | Path) -> RemovalPlan:
    """The shard files `--remove_checkpoint_dir` will delete, decided before merging: refused
    (MergeError) when optimizer or trainer state shares the shard files, or when a shard is
    reached through a symbolic link."""
    model_dir = candidate.model_dir.absolute()
    shared, beside = state_of(candidate)
    if shared:
        raise MergeError(
            f"{model_dir} holds optimizer state in the same files as the model weights; "
            f"removing the shards would delete it ({candidate.layout}: {beside}) - "
            f"{NOT_REMOVED}"
        )
    fmt = format_named(candidate.kind)
    files = fmt.shard_files(model_dir)
    links = _links(Path(root).absolute(), model_dir, files)
    if links:
        raise MergeError(
            f"{links[0]} is a symbolic link (to {os.readlink(links[0])}); "
            "--remove_checkpoint_dir never deletes through symbolic links - give the real path "
            f"of the checkpoint, or {NOT_REMOVED}",
            [f"also a symbolic link: {p}" for p in links[1:]],
        )
    shards = []
    for f in files:
        st = os.lstat(model_dir / f)
        if not stat.S_ISREG(st.st_mode):
            raise MergeError(f"{model_dir / f}: not a regular file; {NOT_REMOVED}")
        shards.append(ShardFile(f, _identity(st)))
    log.info(
        "--remove_checkpoint_dir: after verification, %d shard files of %s will be removed (%s)",
        len(shards),
        model_dir,
        fmt.shards_described,
    )
    return RemovalPlan(Path(root).absolute(), model_dir, tuple(shards))


def _open_below(fd: int, parts: tuple[str, ...], where: Path) -> int:
    """The folder `parts` below directory `fd`, opened without following a symbolic link."""
    for part in parts:
        try:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise MergeError(
                f"{where}: cannot open {part!r} without following a link ({exc.strerror}); "
                "the shards were not removed"
            ) from None
        os.close(fd)
        fd = nfd
    return fd


def _open_model_dir(plan: RemovalPlan) -> tuple[int, int]:
    """(descriptor of the model folder's parent, of the model folder), walked down from the
    checkpoint path given without following a symbolic link."""
    try:
        rel = PurePath(plan.model_dir.relative_to(plan.root))
    except ValueError:
        rel = PurePath()
    top = plan.root if rel.parts else plan.model_dir
    try:
        parent = os.open(top.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise MergeError(f"{top.parent}: {exc.strerror}; the shards were not removed") from None
    parts = (top.name, *rel.parts)
    parent = _open_below(parent, parts[:-1], plan.model_dir)
    try:
        model = os.open(parts[-1], _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        os.close(parent)
        raise MergeError(
            f"{plan.model_dir}: cannot open it without following a link ({exc.strerror}); the "
            "shards were not removed"
        ) from None
    return parent, model


def remove_shards(plan: RemovalPlan) -> Removed:
    """Delete the planned shard files (all checked first: each still a regular file, the one
    the merge read), then the model folder if nothing else is left in it."""
    parent, model = _open_model_dir(plan)
    folders: dict[PurePath, int] = {PurePath(): model}
    try:
        for f in plan.files:
            path, sub = plan.model_dir / f.relative, f.relative.parent
            if sub not in folders:
                folders[sub] = _open_below(os.dup(model), sub.parts, plan.model_dir)
            try:
                st = os.stat(f.relative.name, dir_fd=folders[sub], follow_symlinks=False)
            except OSError as exc:
                raise MergeError(f"{path}: {exc.strerror}; no shard was removed") from None
            if not stat.S_ISREG(st.st_mode) or _identity(st) != f.identity:
                raise MergeError(
                    f"{path}: changed while the merge ran; no shard was removed (the merged "
                    "output is complete)"
                )
        removed = []
        for f in plan.files:
            os.unlink(f.relative.name, dir_fd=folders[f.relative.parent])
            removed.append(plan.model_dir / f.relative)
            log.info("removed %s", plan.model_dir / f.relative)
        for sub in folders:
            if len(sub.parts) == 1:  # a sub-folder that held shards, if now empty
                with contextlib.suppress(OSError):
                    os.rmdir(sub.name, dir_fd=model)
        left = sorted(os.listdir(model))
        if not left:
            os.rmdir(plan.model_dir.name, dir_fd=parent)
            log.info("removed the empty folder %s", plan.model_dir)
        else:
            listed = ", ".join(left[:MAX_LISTED]) + (", ..." if len(left) > MAX_LISTED else "")
            log.info("kept %s: it holds %d other entries (%s)", plan.model_dir, len(left), listed)
        return Removed(tuple(removed), not left, tuple(left))
    finally:
        for fd in folders.values():
            os.close(fd)
        os.close(parent)
