"""A command validates its config once: load_cfg validates, everything after it hands the
typed config on (a real merge, through the Python API and the CLI, and inspect)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from helpers.tiny import make_model
from shardforge.config import ShardforgeConfig, coerce_cfg, load_cfg, validate_cfg


class Counting:
    """Stands in for ShardforgeConfig's pydantic validator and counts what it validates (every
    way in goes through it: `model_validate`, `ShardforgeConfig(...)`, `validate_cfg`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def validate_python(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.validate_python(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counting]:
    counting = Counting(ShardforgeConfig.__pydantic_validator__)
    monkeypatch.setattr(ShardforgeConfig, "__pydantic_validator__", counting)
    yield counting


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config and one single-process DCP save of a tiny Llama in shardforge's layout."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("one-validation")
    base = make_model(root / "base", "llama", vocab_size=320)
    ckpt = root / "run" / "checkpoint-1"
    sd = AutoModelForCausalLM.from_pretrained(base).state_dict()
    dcp.save(sd, checkpoint_id=ckpt / "model", no_dist=True)
    (ckpt / "trainer_state.json").write_text("{}")
    cfg = root / "cfg.yml"
    cfg.write_text(yaml.safe_dump({"base_model": str(base), "output_dir": str(root / "run")}))
    return cfg


def test_the_counter_sees_every_way_in(validations: Counting) -> None:
    validate_cfg({"base_model": "m"})
    ShardforgeConfig(base_model="m")
    ShardforgeConfig.model_validate({"base_model": "m"})
    assert validations.calls == 3


def test_load_then_coerce_validates_once(run: Path, validations: Counting) -> None:
    cfg = load_cfg(run, command="merge")
    assert validations.calls == 1
    assert coerce_cfg(cfg, command="merge") is cfg
    assert validations.calls == 1
    coerce_cfg(str(run), command="merge")  # a path is read: once more, once only
    assert validations.calls == 2


def test_one_merge_from_load_cfg_validates_once(
    run: Path, tmp_path: Path, validations: Counting
) -> None:
    from shardforge.merge.api import merge_fsdp_weights

    out = merge_fsdp_weights(load_cfg(run, command="merge"), tmp_path / "merged", quiet=True)
    assert (out / "model.safetensors").is_file()
    assert validations.calls == 1


def test_one_merge_from_a_path_validates_once(
    run: Path, tmp_path: Path, validations: Counting
) -> None:
    from shardforge.merge.api import merge_fsdp_weights

    merge_fsdp_weights(str(run), tmp_path / "merged", quiet=True)
    assert validations.calls == 1


def test_one_cli_merge_validates_once(run: Path, tmp_path: Path, validations: Counting) -> None:
    from shardforge.cli.main import cli

    out = tmp_path / "merged"
    args = [str(run), "--output_path", str(out), "--quiet", "--output_dir", str(run.parent / "run")]
    result = CliRunner().invoke(cli, ["merge-sharded-fsdp-weights", *args])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file()
    assert validations.calls == 1


def test_inspect_of_a_config_validates_once(run: Path, validations: Counting) -> None:
    from shardforge.cli.inspect import do_inspect

    assert "checkpoint-1" in do_inspect(str(run))
    assert validations.calls == 1
