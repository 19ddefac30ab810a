"""`io.dist.finish_together` on real gloo ranks: every call waits for every rank's call of the
same number (a job that ends together twice, e.g. a merge on ranks and then its rank entry)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.dist import run_on_ranks

pytestmark = pytest.mark.slow  # two spawned processes


def _twice(rank: int, world: int, out: str) -> None:
    from shardforge.io.dist import finish_together

    finish_together()
    if rank == 1:
        time.sleep(1.0)  # late to the second meeting
    started = time.monotonic()
    finish_together()
    Path(out, f"waited.{rank}").write_text(f"{time.monotonic() - started:.3f}")


def test_a_second_finish_waits_for_every_rank_again(tmp_path: Path) -> None:
    run_on_ranks(_twice, 2, str(tmp_path))
    # rank 0 waited for the late rank 1 (a shared key would have let it through at once)
    assert float((tmp_path / "waited.0").read_text()) >= 0.5
