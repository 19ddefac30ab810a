"""Fixtures for the training tests."""

from __future__ import annotations

from typing import Any

import pytest
from train_helpers import make_base


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny base model and data sets, and the config that trains on them (module-scoped)."""
    return make_base(tmp_path_factory.mktemp("train"))
