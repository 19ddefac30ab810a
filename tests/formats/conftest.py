"""The checkpoints every format's tests read: written once per test run by each format's own
saving API on 2 gloo ranks (`helpers.shared.saved_formats`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.shared import saved_formats


@pytest.fixture(scope="session")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_formats(tmp_path_factory)
