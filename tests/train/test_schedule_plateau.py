"""lr_scheduler: reduce_lr_on_plateau in whole runs on one rank in this process: the lr is cut
by `factor` once `patience` evaluations in a row have not improved the metric, and a resume
continues the scheduler's count and its lr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_helpers import read_metrics

from shardforge.config import validate_cfg
from shardforge.train.loop import run_training

# `threshold` 100 in abs mode: only the first evaluation improves on the best (inf), every later
# one is an evaluation without improvement, whatever the losses are
KWARGS = {"patience": 1, "factor": 0.5, "threshold": 100.0, "threshold_mode": "abs"}


def _cfg(base_cfg: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    return {
        **base_cfg,
        "output_dir": str(out),
        "micro_batch_size": 6,
        "learning_rate": 1e-3,
        "lr_scheduler": "reduce_lr_on_plateau",
        "lr_scheduler_kwargs": KWARGS,
        "max_steps": 6,
        "val_set_size": 6,
        "eval_steps": 1,
        "save_steps": 4,
        **extra,
    }


def _lrs(out: Path) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in read_metrics(out) if "lr" in m}


def test_the_lr_drops_after_patience_evaluations_and_resumes(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """Evaluations after steps 1..6: step 1's improves, 2 and 3 do not (3 > patience: lr / 2),
    4 and 5 do not (lr / 4). The lr of step k is the one after the evaluation of step k - 1."""
    out = tmp_path / "a"
    run_training(validate_cfg(_cfg(base_cfg, out)))
    lr = 1e-3
    assert _lrs(out) == pytest.approx({1: lr, 2: lr, 3: lr, 4: lr / 2, 5: lr / 2, 6: lr / 4})
    # from checkpoint-4 (its evaluation without improvement counted): evaluation 5 cuts again
    resumed = tmp_path / "b"
    checkpoint = str(out / "checkpoint-4")
    run_training(validate_cfg(_cfg(base_cfg, resumed, resume_from_checkpoint=checkpoint)))
    assert _lrs(resumed) == pytest.approx({5: lr / 2, 6: lr / 4})


def test_it_needs_evaluation_data(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reduce_lr_on_plateau steps on each evaluation"):
        validate_cfg(_cfg(base_cfg, tmp_path, val_set_size=None, eval_steps=None))
