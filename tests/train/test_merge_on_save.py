"""`merge_on_save`: every checkpoint becomes a loadable model under output_dir/merged while the
run trains as it would without it; a merge that fails never stops training."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import LORA, Run, losses, read_metrics, shared_run, write_config

from shardforge.train import checkpointing as ckpt


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks, 6 steps, a checkpoint every 2 steps, no merging (`shared_run`, read only)."""
    return shared_run(tmp_path_factory, "reference")


@pytest.fixture(scope="module")
def merging(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same with merge_on_save: true and save_total_limit: 2 (`shared_run`)."""
    run = shared_run(tmp_path_factory, "merging")
    assert run.cfg["merge_on_save"] is True and run.cfg["save_total_limit"] == 2
    return run


def _dcp_weights(base_model: str, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights read by torch's own DCP loader into a transformers model
    (not through the merge)."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(base_model).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(checkpoint / "model"), no_dist=True)
    return state


def test_every_checkpoint_is_merged_and_the_losses_stay_the_same(
    plain: Run, merging: Run, base_cfg: dict[str, Any]
) -> None:
    """merged/checkpoint-N for N = 2, 4, 6 loads with AutoModelForCausalLM and holds the
    weights of checkpoint-N (of the run without merging: the same bytes), bit for bit; the
    losses are those of the run without merging; when the run exits its merges are done."""
    from transformers import AutoModelForCausalLM

    assert losses(merging.out) == losses(plain.out)
    merged_dirs = sorted(p.name for p in (merging.out / "merged").iterdir())
    assert merged_dirs == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # nothing half-done
    previous = None
    for name in merged_dirs:
        model = AutoModelForCausalLM.from_pretrained(merging.out / "merged" / name)
        want = _dcp_weights(base_cfg["base_model"], plain.out / name)
        got = model.state_dict()
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (name, key)
        assert previous is None or not torch.equal(previous, got["model.norm.weight"])
        previous = got["model.norm.weight"]
        assert f"merge_on_save: merged {name} into" in merging.stderr
    # rotation waited for the merges: only the newest 2 checkpoints remain
    assert [p.name for p in ckpt.complete_checkpoints(merging.out)] == [
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert "merge_on_save: 3 checkpoint(s) merged" in merging.stderr


def _train_here(cfg: dict[str, Any], config: Path) -> None:
    """One rank in this process (real gloo, DCP; the merges are real subprocesses)."""
    from shardforge.train.launch import do_train

    assert do_train(write_config(config, cfg), [], "python") == 0


def test_a_failing_merge_does_not_stop_training(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """output_dir/merged is a file, so no merge can write its output: each failure is one
    warning line, and training runs to its last step and saves every checkpoint."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "merged").write_text("not a directory\n")
    cfg = {
        **base_cfg,
        "output_dir": str(out),
        "micro_batch_size": 6,
        "max_steps": 4,
        "merge_on_save": True,
    }
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, tmp_path / "cfg.yml")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and not r.getMessage().startswith("notice: sample_packing")
    ]  # (the dense-mask notice of packing on a CPU aside)
    assert len(warned) == 2, warned
    for step, line in zip((2, 4), warned, strict=True):
        assert f"merge_on_save: merging checkpoint-{step} failed (exit status" in line
        assert "training goes on" in line and "\n" not in line
    assert "0 checkpoint(s) merged" in caplog.text and "2 failed" in caplog.text
    assert (out / "merged").is_file()


def test_a_lora_run_merges_its_final_checkpoint_to_an_adapter(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """adapter: lora with merge_on_save: final: only the last checkpoint is merged, into a
    PEFT adapter directory whose weights are the run's final adapter (and load with peft)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    cfg = {
        **base_cfg,
        **LORA,
        "output_dir": str(out),
        "micro_batch_size": 6,
        "max_steps": 4,
        "merge_on_save": "final",
    }
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, tmp_path / "cfg.yml")
    assert sorted(p.name for p in (out / "merged").iterdir()) == ["checkpoint-4"]
    adapter = out / "merged" / "checkpoint-4"
    assert (adapter / "adapter_config.json").is_file()
    got = load_file(str(adapter / "adapter_model.safetensors"))
    want = load_file(str(out / "adapter_model.safetensors"))  # the run's own final adapter
    assert got.keys() == want.keys() and got
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    base = AutoModelForCausalLM.from_pretrained(base_cfg["base_model"])
    model = PeftModel.from_pretrained(base, str(adapter))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 17, 42]])).logits).all()
    assert "merge_on_save: merged checkpoint-4" in caplog.text


def _stored_dtypes(folder: Path) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for f in folder.glob("*.safetensors") for t in load_file(str(f)).values()}


def test_a_bf16_base_trained_in_bf16_merges_to_bf16_unless_dtype_says_otherwise(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bfloat16 base trained with `bf16: true` (float32 master weights in the checkpoint):
    the run's config.json and each checkpoint record bfloat16, and its merges, merge_on_save's
    and the command's, are bfloat16 by default, saying why; `--dtype float32` still gives
    float32, and the bfloat16 merge is that float32 merge cast."""
    import json

    from safetensors.torch import load_file

    from helpers.tiny import make_model
    from shardforge.config import load_cfg
    from shardforge.merge.api import merge_fsdp_weights

    base = make_model(tmp_path / "base", "llama", vocab_size=320, seed=0, dtype="bfloat16")
    out = tmp_path / "out"
    cfg = {
        **base_cfg,
        "base_model": str(base),
        "output_dir": str(out),
        "bf16": True,
        "micro_batch_size": 6,
        "max_steps": 2,
        "merge_on_save": "final",
    }
    config = tmp_path / "cfg.yml"
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, config)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    state = json.loads((out / "checkpoint-2" / ckpt.STATE_FILE).read_text())
    assert state["base_dtype"] == "bfloat16"
    on_save = out / "merged" / "checkpoint-2"
    assert _stored_dtypes(on_save) == {torch.bfloat16}
    assert json.loads((on_save / "config.json").read_text())["dtype"] == "bfloat16"

    merge_cfg = load_cfg(config, command="merge")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="shardforge"):
        merge_fsdp_weights(merge_cfg, tmp_path / "default", quiet=True)
    assert "output dtype: bfloat16 (the base model's stored dtype, recorded by train)" in (
        caplog.text
    )
    assert "early copy accepted" in caplog.text  # its guess chose the same dtype
    merge_fsdp_weights(merge_cfg, tmp_path / "fp32", dtype="float32", quiet=True)
    assert _stored_dtypes(tmp_path / "fp32") == {torch.float32}
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    bf16 = load_file(str(tmp_path / "default" / "model.safetensors"))
    fp32 = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    assert bf16.keys() == fp32.keys()
    for key, tensor in fp32.items():
        assert torch.equal(bf16[key], tensor.to(torch.bfloat16)), key
    on_save_weights = load_file(str(on_save / "model.safetensors"))
    assert all(torch.equal(on_save_weights[k], t) for k, t in bf16.items())
