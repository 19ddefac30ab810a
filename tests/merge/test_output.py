"""Nothing lost: the temporary sibling directory, the rename, the space and overlap checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.errors import MergeError
from shardforge.io.publish import atomic_directory, check_free_space, check_output_path


def test_success_renames_the_temporary_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_directory(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "f").write_text("new")
        assert not out.exists()
    assert (out / "f").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failure_leaves_nothing_and_keeps_the_previous_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(out) as tmp:
        (tmp / "f").write_text("partial")
        raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["old"]
    with pytest.raises(KeyboardInterrupt), atomic_directory(tmp_path / "new"):
        raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()


def test_replace_happens_only_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
        assert (out / "old").exists()
    assert [p.name for p in out.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_checks(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoint-1" / "model"
    ckpt.mkdir(parents=True)
    check_output_path(tmp_path / "run" / "merged", False, [ckpt])
    for bad in (ckpt, ckpt / "x", tmp_path / "run"):
        with pytest.raises(MergeError, match="overlaps the checkpoint"):
            check_output_path(bad, True, [ckpt])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(MergeError, match="--overwrite"):
        check_output_path(tmp_path / "full", False, [])
    with pytest.raises(MergeError, match=r"holds more than a model \(f\)"):
        check_output_path(tmp_path / "full", True, [])
    check_output_path(tmp_path / "full", True, [], non_model=True)
    (tmp_path / "empty").mkdir()
    check_output_path(tmp_path / "empty", False, [])
    with pytest.raises(MergeError, match="not a directory"):
        check_output_path(tmp_path / "full" / "f", True, [])


def test_free_space_is_checked(tmp_path: Path) -> None:
    check_free_space(tmp_path / "a" / "b", 1000)
    with pytest.raises(MergeError, match="not enough free disk space"):
        check_free_space(tmp_path / "a" / "b", 10**18)
