"""Axolotl's training options in whole runs: under FSDP2 on 2 ranks where sharding matters
(unfrozen_parameters, qat, save_only_model: the shared run `options`), the rest on one rank in
this process (save_first_step, early_stopping_patience, load_best_model_at_end)."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import OPTIONS, losses, read_metrics, shared_run

from shardforge.config import validate_cfg
from shardforge.train.loop import run_training


def _dcp(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors (DCP, read in this process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(checkpoint_id=str(folder / "model"))
    assert dcp is not None
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_options_under_fsdp2_on_two_ranks(
    base_cfg: dict[str, Any],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The shared 2-rank run `options`: unfrozen_parameters trains exactly its parameters and
    rows, with a transformer block half frozen (one FSDP2 unit, mixed requires_grad); qat
    fake-quantizes the forward (the first loss is not the reference run's, from the same
    weights) and the merged model is a plain one transformers loads; save_only_model writes no
    optimizer state, and a resume from it (1 rank, here) says so and trains on."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardforge.merge.api import merge_fsdp_weights

    run = shared_run(tmp_path_factory, "options")
    reference = losses(shared_run(tmp_path_factory, "reference").out)
    got = losses(run.out)
    assert list(got) == [1, 2, 3, 4]
    assert got[1] != pytest.approx(reference[1], rel=1e-4)  # qat: another forward
    for step in (2, 4):
        folder = run.out / f"checkpoint-{step}"
        assert not (folder / "optimizer").exists()
        assert json.loads((folder / "trainer_state.json").read_text())["optimizer"] is False
    base = load_file(str(Path(base_cfg["base_model"]) / "model.safetensors"))
    trained = _dcp(run.out / "checkpoint-4")
    assert sorted(trained) == sorted(base)  # plain names: no fake-quantizer state
    changed = {k for k in base if not torch.equal(base[k], trained[k])}
    assert changed == {f"model.layers.1.mlp.{m}_proj.weight" for m in ("gate", "up", "down")} | {
        "model.embed_tokens.weight"
    }
    embed = "model.embed_tokens.weight"
    assert torch.equal(base[embed][:100], trained[embed][:100])

    merged = merge_fsdp_weights(
        {"base_model": base_cfg["base_model"], "output_dir": str(run.out)},
        tmp_path / "merged",
        checkpoint=run.out / "checkpoint-4",
        quiet=True,
    )
    _, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert "quantization_config" not in json.loads((Path(merged) / "config.json").read_text())

    out = tmp_path / "resumed"
    cfg = {
        **base_cfg,
        **OPTIONS,
        "output_dir": str(out),
        "micro_batch_size": 6,  # the same global batch on 1 rank
        "resume_from_checkpoint": str(run.out / "checkpoint-2"),
        "save_steps": None,
    }
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        result = run_training(validate_cfg(cfg))  # one rank, in this process (gloo)
    assert "checkpoint-2 was saved with save_only_model and holds no optimizer state" in caplog.text
    assert result.steps == 4 and [m["step"] for m in result.metrics] == [3, 4]


def test_save_first_step_early_stopping_and_the_best_model(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A learning rate that makes the evaluation loss worse after a while: the run stops once
    `early_stopping_patience` (1) evaluation has not improved; save_first_step wrote
    checkpoint-1; the final checkpoint holds the model of the best evaluated checkpoint."""
    out = tmp_path / "out"
    cfg = {
        **base_cfg,
        "output_dir": str(out),
        "micro_batch_size": 6,
        "learning_rate": 0.3,
        "warmup_steps": 0,
        "lr_scheduler": "constant",
        "max_steps": 12,
        "val_set_size": 6,
        "eval_steps": 1,
        "save_steps": 2,
        "save_first_step": True,
        "save_total_limit": 1,
        "early_stopping_patience": 1,
        "load_best_model_at_end": True,
    }
    with caplog.at_level(logging.INFO, logger="shardforge"):
        result = run_training(validate_cfg(cfg))  # one rank, in this process (gloo)
    evals = {m["step"]: m["eval_loss"] for m in read_metrics(out) if "eval_loss" in m}
    last = result.steps
    assert last < 12  # stopped early
    assert evals[last] >= min(v for s, v in evals.items() if 0 < s < last)  # no improvement
    saved = [s for s in evals if s in (1, last) or (s > 0 and s % 2 == 0)]
    best = min(saved, key=lambda s: evals[s])
    assert best != last
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    # save_total_limit 1 kept the best one beside the last
    assert names == sorted({f"checkpoint-{best}", f"checkpoint-{last}"})
    final, chosen = _dcp(out / f"checkpoint-{last}"), _dcp(out / f"checkpoint-{best}")
    assert all(torch.equal(final[k], chosen[k]) for k in chosen)
    assert f"saved {out / 'checkpoint-1'}" in caplog.text  # save_first_step
    assert f"the model of checkpoint-{best} (eval_loss" in caplog.text
