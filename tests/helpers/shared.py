"""A folder built once per test run and shared by every test and xdist worker that asks for it
(an expensive input, such as checkpoints written by gloo ranks, that tests only read).

    root = shared_folder(tmp_path_factory, "inspect-checkpoints", build)   # build(root)

Tests must not change what is in it (copy first). The builder starts child processes, so a
test that gets the folder counts as starting them (`helpers.children`), whether it built the
folder or found it built.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import children


def shared_folder(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, the same for every xdist worker
    root = shared / name
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "DONE").exists():
            children.started(f"{name}: shared, built by another test's child processes")
        else:
            shutil.rmtree(root, ignore_errors=True)  # what a failed build left
            build(root)
            (root / "DONE").touch()
    return root
