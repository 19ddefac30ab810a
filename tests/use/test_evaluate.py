"""`evaluate_model`: the eval loss of a checkpoint, a merged model or an adapter equals the eval
loss `train` logged for the same weights (training's own data pipeline and loss)."""

from __future__ import annotations

import math

import pytest

from helpers.runs import Runs
from shardforge.config import load_cfg
from shardforge.errors import ConfigError
from shardforge.use.evaluate import evaluate_model

pytestmark = pytest.mark.slow  # the runs are trained under torchrun


def test_each_checkpoint_equals_the_eval_loss_train_logged_at_its_step(runs: Runs) -> None:
    """2 ranks trained and evaluated (FSDP, every rank a share of the chunks); one process
    evaluates the checkpoint merged on the fly: the same loss to 1e-6, the same tokens."""
    cfg = load_cfg(runs.full_cfg)
    logged = runs.evals("full")
    assert sorted(logged) == [0, 2, 4]
    for step in (2, 4):
        result = evaluate_model(cfg, step=step)
        assert result.loss == pytest.approx(logged[step]["eval_loss"], abs=1e-6), step
        assert result.tokens == logged[step]["eval_tokens"] > 0
        assert result.perplexity == pytest.approx(math.exp(result.loss))
    assert logged[4]["eval_loss"] < logged[2]["eval_loss"]  # the steps differ: not one number


def test_the_runs_latest_and_its_merged_output_are_the_last_step(runs: Runs) -> None:
    cfg = load_cfg(runs.full_cfg)
    last = runs.evals("full")[4]["eval_loss"]
    assert evaluate_model(cfg).loss == pytest.approx(last, abs=1e-6)  # checkpoint-4, merged
    assert evaluate_model(cfg, model_dir=runs.merged).loss == pytest.approx(last, abs=1e-6)


def test_an_adapter_and_its_checkpoint_equal_the_lora_runs_eval_loss(runs: Runs) -> None:
    """The LoRA run's adapter on the base model (peft), its checkpoint merged with the adapter
    fused, and merge-lora's fused model: the eval loss train logged at its last step."""
    cfg = load_cfg(runs.lora_cfg)
    logged = runs.evals("lora")[2]["eval_loss"]
    assert evaluate_model(cfg).loss == pytest.approx(logged, abs=1e-6)  # the adapter
    assert evaluate_model(cfg, step=2).loss == pytest.approx(logged, abs=1e-6)
    fused = evaluate_model(cfg, model_dir=runs.fused).loss
    assert fused == pytest.approx(logged, abs=1e-5)


def test_test_datasets_are_evaluated_and_no_eval_data_is_an_error(runs: Runs) -> None:
    cfg = load_cfg(runs.full_cfg)
    data = cfg.datasets[0].path
    tested = load_cfg(runs.full_cfg, val_set_size=0, test_datasets=[{"path": data}])
    result = evaluate_model(tested, step=4)
    assert result.tokens > runs.evals("full")[4]["eval_tokens"]  # every sample, not a tenth
    with pytest.raises(ConfigError, match=r"val_set_size: the config has no evaluation data"):
        evaluate_model(load_cfg(runs.full_cfg, val_set_size=0), step=4)
