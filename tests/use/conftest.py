"""Fixtures of the `inference` / `evaluate` tests: the tiny example's trained runs (built once
per session, see helpers/runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers.runs import Runs, trained_runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return trained_runs(tmp_path_factory)


@pytest.fixture(scope="session")
def parrot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny merged model whose every chat reply is PARROT_ANSWER (built in this process)."""
    from helpers.shared import shared_folder
    from helpers.tiny import PARROT_ANSWER, make_parrot_model

    root = shared_folder(
        tmp_path_factory,
        "parrot-model",
        lambda root: make_parrot_model(root, PARROT_ANSWER),
        starts_children=False,
    )
    return root


@pytest.fixture
def parrot_cfg(parrot: Path, tmp_path: Path) -> Path:
    """A config of the parrot model that chats with the tokenizer's template."""
    path = tmp_path / "chat.yml"
    data = {
        "base_model": str(parrot),
        "output_dir": str(tmp_path / "out"),
        "chat_template": "tokenizer_default",
    }
    path.write_text(yaml.safe_dump(data))
    return path
