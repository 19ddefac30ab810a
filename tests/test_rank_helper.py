"""`helpers.dist.run_on_ranks`, which many tests use: a rank's failure reaches the test with the
rank's own error, and nothing of it stays behind in the temporary folder."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from helpers.dist import run_on_ranks, run_on_spawned_ranks

pytestmark = pytest.mark.slow  # a spawned process


def _leave_the_group_and_fail(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()  # as a function that makes its own groups does
    raise ValueError("the rank's own error")


@pytest.mark.parametrize("run", [run_on_ranks, run_on_spawned_ranks])
def test_a_failed_rank_raises_its_error_and_leaves_no_error_file(
    run: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Exception, match="the rank's own error"):
        run(_leave_the_group_and_fail, 1)
    # torch's spawn passes the traceback in pytorch-errorfile-*.pickle and never removes it
    assert list(tmp_path.iterdir()) == []
