"""Fixtures for the training tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from train_helpers import shared_base


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny base model and data sets (made once per test run, shared: read only), and the
    config that trains on them, with its output_dir in this module's own folder."""
    out = tmp_path_factory.mktemp("train") / "out"
    return {**shared_base(tmp_path_factory), "output_dir": str(out)}


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone (no child process), torn down afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
