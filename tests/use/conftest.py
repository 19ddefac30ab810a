"""Fixtures of the `inference` / `evaluate` tests: the tiny example's trained runs (built once
per session, see helpers/runs.py)."""

from __future__ import annotations

import pytest

from helpers.runs import Runs, trained_runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return trained_runs(tmp_path_factory)
