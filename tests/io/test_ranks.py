"""The launcher's side of a job of ranks: a rank's user error goes through the file once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardforge.errors import ConfigError, ShardforgeError
from shardforge.io import ranks


def test_the_first_ranks_error_reaches_the_launcher_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "rank-error"
    monkeypatch.delenv(ranks.ERROR_FILE_ENV, raising=False)
    assert not ranks.leave_rank_error(ShardforgeError("no launcher"))  # the rank prints it
    ranks.raise_rank_error(error_file)  # nothing left: nothing raised

    monkeypatch.setenv(ranks.ERROR_FILE_ENV, str(error_file))
    assert ranks.leave_rank_error(ConfigError("cfg.yml", ["sequence_len: must be > 0"]))
    assert ranks.leave_rank_error(ShardforgeError("a second rank"))  # the first one stays
    with pytest.raises(ShardforgeError) as info:
        ranks.raise_rank_error(error_file)
    assert "sequence_len: must be > 0" in str(info.value) and "second" not in str(info.value)
    assert info.value.exit_code == ConfigError("x", ["y"]).exit_code


@pytest.mark.slow
def test_run_ranks_returns_the_status_and_splits_openmp_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranks.os, "cpu_count", lambda: 8)
    env: dict[str, str] = {}
    code = "import os, sys; sys.exit(int(os.environ['OMP_NUM_THREADS']))"
    assert ranks.run_ranks([sys.executable, "-c", code], env, 4) == 2
    env = {"OMP_NUM_THREADS": "3"}
    assert ranks.run_ranks([sys.executable, "-c", code], env, 4) == 3
