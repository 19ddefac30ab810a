"""Two saves of one model's shapes with other values, as a checkpoint replaced by a later save
looks: the torture cases of inputs that change under a merge (`io.pins`, `--resume`).

    saves = two_saves(tmp_path)      # saves.base (config + tokenizer), saves.a, saves.b
    replace_files(saves.b, saves.a)  # a's files become b's (new inodes, same sizes)
    change_after_plan(monkeypatch, path, change)  # in-process merge: change() mid-run

Each save is a DCP folder written by `dcp.save(no_dist=True)` in this process (no ranks):
`.metadata` and one `__0_0.distcp` of about 2.5 MB (above `io.mirror.DOWNLOAD_LIMIT`: in a
store, read by ranged GETs). The two folders hold the same file names and sizes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.tiny import make_model

# a vocabulary large enough for a data file above 1 MiB (embeddings and lm_head: 2 x 1 MiB)
VOCAB = 4096


@dataclass(frozen=True)
class Saves:
    base: Path
    a: Path
    b: Path

    def config(self, **more: Any) -> dict[str, Any]:
        """A merge config for these saves."""
        return {"base_model": str(self.base), "output_dir": "unused", **more}


def two_saves(root: Path) -> Saves:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    base = make_model(root / "base", "llama", vocab_size=VOCAB)
    state = AutoModelForCausalLM.from_pretrained(base).state_dict()
    a, b = root / "a", root / "b"
    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=a, no_dist=True)
    dcp.save({k: v + 1.0 for k, v in state.items()}, checkpoint_id=b, no_dist=True)
    sizes = [{p.name: p.stat().st_size for p in d.iterdir()} for d in (a, b)]
    assert sizes[0] == sizes[1], sizes  # another save of the same shapes: the same sizes
    assert (a / "__0_0.distcp").read_bytes() != (b / "__0_0.distcp").read_bytes()
    return Saves(base, a, b)


def replace_files(source: Path, folder: Path, names: tuple[str, ...] | None = None) -> None:
    """Each file of `source` (or only `names`) put in place of the one in `folder`, renamed
    over it (a new inode, as a later save writes it)."""
    for path in sorted(source.iterdir()):
        if names is None or path.name in names:
            part = folder / f".{path.name}.new"
            shutil.copyfile(path, part)
            os.replace(part, folder / path.name)


def rewrite_in_place(path: Path, data: bytes, keep_mtime: bool = False) -> None:
    """`path`'s bytes replaced by `data` in the same inode (its mtime set back when asked, as
    `touch -r` does: only the ctime then tells)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_ino == st.st_ino and path.stat().st_size == st.st_size


def change_after_plan(
    monkeypatch: pytest.MonkeyPatch, path: Path, change: Callable[[], None]
) -> list[int]:
    """An in-process merge calls `change()` once, right after its first open of the input
    `path` once the plan is made (the output sink's journal fingerprinted: every input
    pinned), between two of its reads: deterministic, no sleep. The list returned holds one
    entry once `change` ran."""
    import shardforge.io.copy as copy_module
    import shardforge.sinks.hf_dir as hf_dir

    planned: list[int] = []
    done: list[int] = []
    real = os.path.realpath(path)
    fingerprint, open_regular = hf_dir.resume_fingerprint, copy_module.open_regular

    def fingerprinted(output: Any) -> Any:
        found = fingerprint(output)
        planned.append(1)
        return found

    def open_then_change(p: str | Path, root: str | Path | None = None) -> int:
        fd = open_regular(p, root)
        if planned and not done and os.path.realpath(p) == real:
            done.append(1)
            change()
        return fd

    monkeypatch.setattr(hf_dir, "resume_fingerprint", fingerprinted)
    monkeypatch.setattr(copy_module, "open_regular", open_then_change)
    return done


def shared_saves(tmp_path_factory: pytest.TempPathFactory) -> Saves:
    """`two_saves`, written once per test run and shared by every module and xdist worker that
    asks (`helpers.shared.shared_folder`; no child process): tests read them only (copy a
    save before changing it)."""
    from helpers.shared import shared_folder

    root = shared_folder(tmp_path_factory, "two-saves", two_saves, starts_children=False)
    return Saves(root / "base", root / "a", root / "b")
