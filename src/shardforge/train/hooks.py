"""The seams a feature hooks into the training loop through (`loop.Trainer.fit`)."""

from __future__ import annotations

from typing import Any

# the trainer (`loop.Trainer`), untyped here: the loop imports this module
Trainer = Any


class Callback:
    """A feature hooked into `Trainer.fit`; override the hooks you need (each does nothing by
    default). Hooks run on every rank, in list order (`on_end` in reverse order). Setting
    `trainer.stop = True` ends the run after this step, with the final save: decide it from
    what every rank sees alike (the record's loss, the step), or the ranks part ways."""

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After each optimizer step: its record (step, loss, lr, grad_norm, tokens, ...)."""

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After an evaluation: its record (step, eval_loss, ...)."""

    def before_save(self, trainer: Trainer) -> None:
        """After a step and its evaluation, before the save due then (if any)."""

    def on_end(self, trainer: Trainer, failed: bool) -> None:
        """The run ended; `failed`: by an exception."""
