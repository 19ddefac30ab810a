"""load_best_model_at_end and early_stopping_patience, as Hugging Face's Trainer (and so
Axolotl) does them: the evaluation metric (metric_for_best_model, greater_is_better) picks the
best checkpoint; the final save writes that checkpoint's model; the run stops once
`early_stopping_patience` evaluations in a row have not improved on the best."""

from __future__ import annotations

import logging
from pathlib import Path, PurePath
from typing import Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train import checkpointing as ckpt
from shardforge.train.hooks import Callback

# the trainer (`loop.Trainer`), untyped here: the loop imports this module
Trainer = Any

log = logging.getLogger("shardforge")

EVAL_METRICS = ("eval_loss", "eval_perplexity", "eval_tokens")  # eval.EvalResult.record's


def metric_name(cfg: ShardforgeConfig) -> str:
    """The evaluation record's key of metric_for_best_model (null: eval_loss)."""
    name = cfg.metric_for_best_model or "loss"
    return name if name.startswith("eval_") else f"eval_{name}"


def greater_is_better(cfg: ShardforgeConfig) -> bool:
    if cfg.greater_is_better is not None:
        return cfg.greater_is_better
    return not metric_name(cfg).endswith("loss")


def _checked_metric(cfg: ShardforgeConfig) -> str:
    metric = metric_name(cfg)
    if metric not in EVAL_METRICS:
        raise ConfigError(
            "metric_for_best_model",
            [f"{metric} is not an evaluation metric ({', '.join(EVAL_METRICS)})"],
        )
    return metric


class Plateau(Callback):
    """lr_scheduler reduce_lr_on_plateau: torch's ReduceLROnPlateau stepped with the metric of
    each evaluation (metric_for_best_model, default eval_loss), as transformers' Trainer steps
    it; an evaluation before training (step 0) does not step it."""

    def __init__(self, trainer: Trainer) -> None:
        self.metric = _checked_metric(trainer.cfg)

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if record["step"] > 0:
            trainer.scheduler.step(record[self.metric])


class BestModel(Callback):
    """Tracks the best evaluation; stops early; loads the best checkpoint's model at the end."""

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.metric, self.greater = _checked_metric(cfg), greater_is_better(cfg)
        self.patience = cfg.early_stopping_patience
        self.load_at_end = cfg.load_best_model_at_end
        self.best: float | None = None  # of every evaluation (early stopping)
        self.best_saved: float | None = None  # of the saved steps (the best checkpoint)
        self.best_step: int | None = None
        self.worse = 0  # evaluations in a row without improvement
        if self.load_at_end:
            _check_saves(trainer)

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        step = record["step"]
        if step == 0:  # before training: no checkpoint to pick
            return
        value = float(record[self.metric])
        if self._better(value, self.best):  # early stopping: against every evaluation
            self.best, self.worse = value, 0
        else:
            self.worse += 1
        if self.patience and self.worse >= self.patience and not trainer.final:
            if trainer.rt.is_main:
                log.info(
                    "early stopping at step %d: %d evaluation(s) without improving on %s %.4g",
                    step,
                    self.worse,
                    self.metric,
                    self.best,
                )
            trainer.stop = True
        # the best checkpoint: among the evaluations of the steps that are saved (the step
        # an early stop ends at is: its final save)
        if (trainer.final or trainer.save_due()) and self._better(value, self.best_saved):
            self.best_saved, self.best_step = value, step
            if self.load_at_end:  # save_total_limit keeps it
                trainer.saver.keep = frozenset({PurePath(f"checkpoint-{step}")})

    def _better(self, value: float, than: float | None) -> bool:
        return than is None or (value > than if self.greater else value < than)

    def before_save(self, trainer: Trainer) -> None:
        if not (self.load_at_end and trainer.final):
            return
        if self.best_step is None or self.best_step == trainer.global_step:
            return
        trainer.saver.close()  # a background save of the best checkpoint is complete
        path = Path(trainer.out) / f"checkpoint-{self.best_step}"
        ckpt.load_model_weights(path, trainer.model, adapter_only=trainer.cfg.adapter is not None)
        if trainer.rt.is_main:
            log.info(
                "load_best_model_at_end: the model of %s (%s %.4g) is the final model",
                path.name,
                self.metric,
                self.best_saved,
            )


def _check_saves(trainer: Trainer) -> None:
    """Every checkpoint has an evaluation of its step (save_steps a multiple of eval_steps),
    and the checkpoints are local files."""
    every, evals = trainer.every, trainer.evaluator.every
    if trainer.cfg.save_strategy == "no" or trainer.remote is not None:
        raise ConfigError(
            "load_best_model_at_end", ["needs checkpoints in a local output_dir to pick from"]
        )
    if every is not None and (evals is None or every % evals):
        raise ConfigError(
            "load_best_model_at_end",
            [
                f"checkpoints every {every} steps, evaluations every {evals}: make the save "
                "interval a multiple of the evaluation interval"
            ],
        )
