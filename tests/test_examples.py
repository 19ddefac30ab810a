"""Every config shipped in examples/ validates, and the tiny example's files are present."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardforge.config import load_cfg

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yml")) + sorted((ROOT / "examples").rglob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path: Path) -> None:
    cfg = load_cfg(path)
    assert cfg.base_model


def test_tiny_example_ships_its_model_and_data() -> None:
    cfg = load_cfg(ROOT / "examples" / "tiny-llama.yml")
    base = ROOT / cfg.base_model
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (base / name).is_file(), name
    for ds in cfg.datasets:
        assert (ROOT / ds.path).is_file(), ds.path
