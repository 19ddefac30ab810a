"""The loaded config as a read-only view: Axolotl-style reads, refused writes, no second
validation."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from shardforge.config import ConfigReadOnlyError, ShardforgeConfig, coerce_cfg, load_cfg
from shardforge.errors import ShardforgeError

YAML = (
    "base_model: some/model\n"
    "learning_rate: 0.001\n"
    "fsdp:\n  offload_params: true\n"
    "datasets:\n  - path: a.jsonl\n"
)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "cfg.yml"
    p.write_text(YAML)
    return p


def test_reads_as_attributes_items_and_get(path: Path) -> None:
    cfg = load_cfg(path)
    assert isinstance(cfg, ShardforgeConfig)
    assert cfg.base_model == cfg["base_model"] == cfg.get("base_model") == "some/model"
    assert cfg.fsdp.offload_params is True and cfg["fsdp"]["offload_params"] is True
    assert cfg.fsdp.get("offload_params") is True
    assert cfg.fsdp.mixed_precision.param_dtype is None
    assert cfg.datasets[0].path == cfg["datasets"][0]["path"] == "a.jsonl"
    # a key the config does not have (an Axolotl key, a typo) reads as None through get
    assert cfg.get("gptq") is None
    assert cfg.get("gptq", False) is False
    assert "fsdp" in cfg and "gptq" not in cfg
    assert list(cfg.keys()) == list(ShardforgeConfig.model_fields)
    assert dict(cfg.items())["learning_rate"] == 0.001
    assert dict(cfg)["seed"] == 42


def test_to_dict_is_plain_data(path: Path) -> None:
    cfg = load_cfg(path)
    data = cfg.to_dict()
    assert data == cfg.model_dump(mode="python")
    assert type(data["fsdp"]) is dict and type(data["datasets"][0]) is dict
    assert cfg.to_model() is cfg  # kept for code written for the addict view


def test_unknown_key_suggests_at_every_level(path: Path) -> None:
    cfg = load_cfg(path)
    with pytest.raises(AttributeError, match="config has no key 'ofload_params'; did you mean"):
        _ = cfg.fsdp.ofload_params
    with pytest.raises(KeyError, match="did you mean 'path'"):
        _ = cfg.datasets[0]["pth"]
    assert not hasattr(cfg, "gptq")


@pytest.mark.parametrize(
    ("write", "advice"),
    [
        (
            lambda cfg: setattr(cfg, "learning_rate", 0.5),
            "cannot set learning_rate; pass the change to load_cfg instead: "
            "load_cfg(path, learning_rate=0.5), or on the command line --learning_rate VALUE",
        ),
        (
            lambda cfg: setattr(cfg.fsdp, "offload_params", False),
            "load_cfg(path, **{'fsdp.offload_params': False}), or on the command line "
            "--fsdp.offload_params VALUE",
        ),
        (
            lambda cfg: setattr(cfg.fsdp.mixed_precision, "param_dtype", "bfloat16"),
            "cannot set fsdp.mixed_precision.param_dtype",
        ),
        (
            lambda cfg: setattr(cfg.datasets[0], "path", "b.jsonl"),
            "cannot set path of a list entry; pass the whole list to load_cfg instead",
        ),
        (lambda cfg: delattr(cfg, "seed"), "load_cfg(path, seed=...)"),
    ],
)
def test_writes_are_refused_with_the_override_to_use(path: Path, write, advice: str) -> None:
    cfg = load_cfg(path)
    before = cfg.to_dict()
    with pytest.raises(ConfigReadOnlyError) as info:
        write(cfg)
    message = str(info.value)
    assert message.startswith("the config is read-only (load_cfg validated it once)")
    assert advice in message
    assert len(message) <= 300 and "\n" not in message
    assert isinstance(info.value, AttributeError) and isinstance(info.value, ShardforgeError)
    assert cfg.to_dict() == before


def test_the_advised_override_gives_the_change(path: Path) -> None:
    cfg = load_cfg(path, learning_rate=0.5, **{"fsdp.offload_params": False})
    assert cfg.learning_rate == 0.5 and cfg.fsdp.offload_params is False


def test_a_long_name_keeps_the_line_short(path: Path) -> None:
    with pytest.raises(ConfigReadOnlyError) as info:
        setattr(load_cfg(path).fsdp, "x" * 1000, 1)
    assert len(str(info.value)) <= 300


def test_copies_and_pickles_stay_whole(path: Path) -> None:
    cfg = load_cfg(path)
    for other in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg and other.fsdp.offload_params is True
    changed = cfg.model_copy(update={"learning_rate": 0.5})
    assert changed.learning_rate == 0.5 and cfg.learning_rate == 0.001


def test_coerce_cfg_hands_a_loaded_config_on_as_it_is(path: Path) -> None:
    cfg = load_cfg(path)
    assert coerce_cfg(cfg) is cfg
    assert coerce_cfg(cfg, command="merge") is cfg


def test_a_keys_docstring_is_its_one_line_description() -> None:
    """A key documented by the docstring under it (wrapped over lines, as the source needs)
    gets it as its description, in one line, in the JSON schema too."""
    from pydantic import Field

    from shardforge.config.view import ConfigView

    class Block(ConfigView):
        size: int | None = Field(None, gt=0)
        """How many, wrapped
        over two lines."""
        name: str = Field("x", description="Given as before.")

    info = Block.model_fields["size"]
    assert info.description == "How many, wrapped over two lines."
    assert Block.model_json_schema()["properties"]["size"]["description"] == info.description
    assert Block.model_json_schema()["properties"]["name"]["description"] == "Given as before."
    with pytest.raises(ValueError, match="greater than 0"):
        Block(size=0)
