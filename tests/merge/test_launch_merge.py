"""The distributed merge's launcher (merge/launch.py): what it reports from the ranks' exit.

The ranks' command is replaced by a short Python process that does what a rank's end does to
the launcher's files (the real ranks under torchrun are in test_distributed.py): it leaves the
"published" marker and/or the first rank's error, then exits with a status.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError, ShardforgeError
from shardforge.merge import launch
from shardforge.merge.request import MergeRequest

# each test starts the ranks' stand-in processes
pytestmark = pytest.mark.slow

RANK_END = r"""
import os, pathlib, sys
what, status, done_env, error_env = sys.argv[1:]
if what == "published":
    pathlib.Path(os.environ[done_env]).touch()
if what == "error":
    pathlib.Path(os.environ[error_env]).write_text("3\nbad input: details")
sys.exit(int(status))
"""


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, status: int) -> Path:
    monkeypatch.setattr(
        launch,
        "torchrun_command",
        lambda *_: [
            sys.executable,
            "-c",
            RANK_END,
            what,
            str(status),
            launch.DONE_FILE_ENV,
            launch.ERROR_FILE_ENV,
        ],
    )
    config = ShardforgeConfig.model_validate(
        {"base_model": str(tmp_path / "base"), "output_dir": str(tmp_path / "run")}
    )
    request = MergeRequest(output_path=tmp_path / "out", nproc_per_node=2)
    return launch.launch_merge(config, request)


def test_a_rank_failing_after_the_output_was_published_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 published (the marker exists), then a rank died in torch's teardown: the output
    is complete, so the merge succeeds with a warning."""
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        out = _launch(tmp_path, monkeypatch, "published", 1)
    assert out == (tmp_path / "out").absolute()
    assert any("after the output was published" in r.getMessage() for r in caplog.records)


def test_a_failure_without_the_marker_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(MergeError, match="nothing was published"):
        _launch(tmp_path, monkeypatch, "nothing", 1)


def test_the_first_ranks_error_is_reported_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ShardforgeError, match="bad input: details") as info:
        _launch(tmp_path, monkeypatch, "error", 3)
    assert info.value.exit_code == 3
