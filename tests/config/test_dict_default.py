"""Axolotl's DictDefault: attribute reads, None for a missing key, nested mappings wrapped,
writes allowed, plain dicts back; a config directory holding one YAML file."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from shardforge.config.dict_default import DictDefault, config_file
from shardforge.errors import ConfigError


def test_reads_writes_and_nesting() -> None:
    cfg = DictDefault({"a": 1, "fsdp_config": {"x": True}, "datasets": [{"path": "p"}, 3]}, "c.yml")
    assert (cfg.a, cfg["a"], cfg.fsdp_config.x, cfg.datasets[0].path, cfg.missing) == (
        1,
        1,
        True,
        "p",
        None,
    )
    assert isinstance(cfg.datasets[0], DictDefault) and cfg.datasets[1] == 3
    cfg.b = {"c": 2}
    assert cfg.b.c == 2 and cfg["b"] == {"c": 2}
    del cfg.a
    assert "a" not in cfg and cfg.source == "c.yml"
    plain = cfg.to_dict()
    assert type(plain["fsdp_config"]) is dict and type(plain["datasets"][0]) is dict
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert again == cfg and again.source == "c.yml" and again.fsdp_config.x is True


def test_config_file_of_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a.yml").write_text("base_model: m\n")
    (tmp_path / "notes.txt").write_text("")
    assert config_file(tmp_path) == tmp_path / "a.yml"
    assert config_file(tmp_path / "a.yml") == tmp_path / "a.yml"
    (tmp_path / "b.yaml").write_text("base_model: n\n")
    with pytest.raises(ConfigError, match=r"name one of its config files \(a\.yml, b\.yaml\)"):
        config_file(tmp_path)
