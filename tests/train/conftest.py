"""Fixtures for the training tests."""

from __future__ import annotations

from typing import Any

import pytest
from train_helpers import shared_base


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny base model and data sets (made once per test run, shared: read only), and the
    config that trains on them, with its output_dir in this module's own folder."""
    out = tmp_path_factory.mktemp("train") / "out"
    return {**shared_base(tmp_path_factory), "output_dir": str(out)}
