"""Which weights `inference` / `evaluate` use: the options' or the run's own (full-model save,
adapter, latest checkpoint); every missing or unusable input is one error naming it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.runs import ROOT, Runs
from shardforge.config import load_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.use.model import Picked, load_model, pick
from shardforge.use.request import ModelRequest

BASE = ROOT / "examples" / "tiny-llama" / "base"


def _cfg(tmp_path: Path, **extra: Any) -> ShardforgeConfig:
    path = tmp_path / "cfg.yml"
    data = {"base_model": str(BASE), "output_dir": str(tmp_path / "out"), **extra}
    path.write_text(yaml.safe_dump(data))
    return load_cfg(path)


def _pick(cfg: ShardforgeConfig, **which: Any) -> Picked:
    return pick(cfg, ModelRequest(**which))


def test_a_model_directory_needs_config_and_safetensors(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    model = tmp_path / "model"
    with pytest.raises(CheckpointError, match=r"model: model directory not found \(--model_dir\)"):
        _pick(cfg, model_dir=model)
    model.mkdir()
    with pytest.raises(CheckpointError, match=r"model: no config.json, so not a Hugging Face"):
        _pick(cfg, model_dir=model)
    shutil.copy(BASE / "config.json", model)
    (model / "pytorch_model.bin").write_bytes(b"a pickle")
    with pytest.raises(CheckpointError, match=r"no model.safetensors .*safetensors weights only"):
        _pick(cfg, model_dir=model)
    assert _pick(cfg, model_dir=BASE) == Picked("model", BASE, "--model_dir")


def test_a_damaged_model_is_one_error_when_loaded(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(BASE / "config.json", model)
    (model / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ShardforgeError, match=r"model: cannot load the model \(Error while"):
        load_model(cfg, _pick(cfg, model_dir=model))


def test_an_adapter_directory_is_checked_before_loading(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(CheckpointError, match=r"adapter directory not found"):
        _pick(cfg, lora_model_dir=tmp_path / "adapter")
    (tmp_path / "adapter").mkdir()
    with pytest.raises(CheckpointError, match=r"no adapter_config.json, so not a PEFT adapter"):
        _pick(cfg, lora_model_dir=tmp_path / "adapter")


def test_without_a_run_the_error_says_how_to_name_the_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"out: no such directory: the run has no checkpoint"
    ) as info:
        _pick(cfg)
    assert info.value.details == [
        "or name the model: --model_dir DIR, --lora_model_dir DIR or --checkpoint PATH"
    ]
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match=r"out: an empty directory: the run has no") as info:
        _pick(cfg)
    assert info.value.details[-1].startswith("or name the model")
    with pytest.raises(CheckpointError, match=r"out: an empty directory: no checkpoint$") as info:
        _pick(cfg, step=3)  # an explicit choice: no hint
    assert info.value.details == []


def test_a_full_model_save_in_output_dir_is_the_runs_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    shutil.copytree(BASE, tmp_path / "out")
    assert _pick(cfg) == Picked("model", tmp_path / "out", "the full-model save in output_dir")
    lora = _cfg(tmp_path, adapter="lora", lora_target_linear=True)
    with pytest.raises(CheckpointError, match=r"holds a full Hugging Face model already"):
        _pick(lora)  # a LoRA run's output is an adapter, or a checkpoint to fuse


@pytest.mark.slow  # the runs are trained under torchrun
def test_the_runs_own_weights(runs: Runs) -> None:
    full, lora = load_cfg(runs.full_cfg), load_cfg(runs.lora_cfg)
    out = runs.root / "full"

    def found(n: int) -> str:
        return f"{out}/checkpoint-{n}/model (step {n})"

    assert _pick(full) == Picked("checkpoint", out, "the run's latest", None, found(4))
    assert _pick(full, step=2) == Picked("checkpoint", out, "--step", 2, found(2))
    step_dir = _pick(full, checkpoint=out / "checkpoint-2")
    assert (step_dir.path, step_dir.step, step_dir.how) == (
        out / "checkpoint-2",
        None,
        "--checkpoint",
    )
    assert step_dir.found.startswith(f"{out}/checkpoint-2/model")
    assert _pick(lora) == Picked("adapter", runs.root / "lora", "the adapter in output_dir")
    named = load_cfg(runs.lora_cfg, lora_model_dir=str(runs.root / "lora"))
    assert _pick(named).how == "the config's lora_model_dir"


@pytest.mark.slow  # the runs are trained under torchrun
def test_base_model_names_the_model_as_in_axolotl(runs: Runs, tmp_path: Path) -> None:
    elsewhere = tmp_path / "no-run"  # the run's output_dir is not looked at
    named = load_cfg(runs.full_cfg, base_model=str(runs.merged), output_dir=str(elsewhere))
    assert pick(named, ModelRequest(), named_base=True) == Picked(
        "base", runs.merged, "--base_model", found=str(runs.merged)
    )
    # the config's base_model merged from this run's checkpoints: the run's result
    own = load_cfg(runs.full_cfg, base_model=str(runs.merged))
    assert _pick(own).how == "the config's base_model, merged from this run"
    # merged from another run (training goes on from it): this run's own weights
    with pytest.raises(CheckpointError, match=r"no-run: no such directory"):
        _pick(named)
    # an explicit option still wins; a LoRA run's base_model is what the adapter goes on
    assert _pick(own, step=2).kind == "checkpoint"
    lora = load_cfg(runs.lora_cfg, base_model=str(runs.merged))
    assert pick(lora, ModelRequest(), named_base=True).kind == "adapter"
    with pytest.raises(ShardforgeError, match=r"base_model: directory .*no-run not found"):
        pick(load_cfg(runs.full_cfg, base_model=str(elsewhere)), ModelRequest(), True)


def test_loaded_as_training_computes_remote_code_only_when_allowed(tmp_path: Path) -> None:
    import torch

    from shardforge.use.model import _model_kwargs

    assert _model_kwargs(_cfg(tmp_path)) == {
        "dtype": torch.float32,
        "trust_remote_code": False,
        "use_safetensors": True,
    }
    cfg = _cfg(tmp_path, bf16=True, attn_implementation="eager", trust_remote_code=True)
    assert _model_kwargs(cfg) == {
        "dtype": torch.bfloat16,
        "trust_remote_code": True,
        "use_safetensors": True,
        "attn_implementation": "eager",
    }
    # training's varlen_attention has no KV cache: the model generates with sdpa
    assert "attn_implementation" not in _model_kwargs(
        _cfg(tmp_path, attn_implementation="varlen_attention")
    )


def test_weights_in_object_storage_are_one_error_saying_what_to_do(tmp_path: Path) -> None:
    """The model is loaded from local files: an s3:// run (output_dir) or option is one error
    naming the URI, with the merge that brings the model down."""
    cfg = _cfg(tmp_path, output_dir="s3://runs/run-1")
    with pytest.raises(CheckpointError) as err:
        _pick(cfg)
    assert err.value.message.startswith("s3://runs/run-1 (the config's output_dir): ")
    assert "shardforge merge-sharded-fsdp-weights CFG --output_path DIR" in err.value.message
    for option in ("model_dir", "lora_model_dir", "checkpoint"):  # refused as parsed
        with pytest.raises(ShardforgeError, match=rf"^--{option} s3://runs/m: the model is "):
            _pick(_cfg(tmp_path), **{option: "s3://runs/m"})
    assert _pick(cfg, model_dir=BASE).path == BASE  # a local model with an s3:// run: fine


def test_a_deep_manifest_beside_the_base_model_is_no_traceback(tmp_path: Path) -> None:
    """The manifest a base model folder carries is read as untrusted JSON (io.files.read_json):
    nested past the parser's recursion it is simply not this run's, not a RecursionError."""
    from shardforge.sinks.manifest import MANIFEST
    from shardforge.use.model import merged_from_run

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    cfg = ShardforgeConfig(base_model=str(tmp_path / "base"), output_dir=str(tmp_path / "run"))
    assert merged_from_run(cfg) is False


def test_base_model_with_another_model_option_is_refused(tmp_path: Path) -> None:
    cfg = ShardforgeConfig(base_model=str(tmp_path / "m"), output_dir=str(tmp_path / "run"))
    for options in ({"model_dir": tmp_path / "d"}, {"step": 2}, {"checkpoint": tmp_path / "c"}):
        with pytest.raises(ShardforgeError, match="each name the model; give one of them"):
            pick(cfg, ModelRequest(**options), named_base=True)
