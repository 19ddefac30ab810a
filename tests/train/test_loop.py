"""Training at different world sizes computes the same thing (fp32, gloo, real torchrun)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from train_helpers import read_metrics, shared_run, write_config

from shardforge.config import validate_cfg
from shardforge.train.loop import Callback, Trainer, run_training

# fp32 on CPU: 1-rank and 2-rank runs differ only in the order of floating-point reductions
# (gradient reduce-scatter, loss all-reduce), measured at about 1e-7 relative.
RTOL = 1e-6


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=0.0)


def test_two_ranks_match_one_rank(
    base_cfg: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The shared 2-rank run (`shared_run`: micro batch 3) and the same global batch of 12
    sequences on 1 rank (micro batch 6, in this process)."""
    from shardforge.train.launch import do_train

    out = tmp_path / "ranks1"
    cfg = {**base_cfg, "output_dir": str(out), "micro_batch_size": 6, "save_steps": None}
    assert do_train(write_config(tmp_path / "r1.yml", cfg), [], "python") == 0
    one, two = read_metrics(out), read_metrics(shared_run(tmp_path_factory, "reference").out)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(one, two, strict=True):
        assert _close(a["loss"], b["loss"]), (a, b)
        # the clipped-by norm is the global norm over all shards, not a rank-local one
        assert _close(a["grad_norm"], b["grad_norm"]), (a, b)
        assert a["lr"] == b["lr"]
        assert a["tokens"] == b["tokens"]
    # the model learns, and clipping was active (norms above max_grad_norm 1.0)
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    assert max(m["grad_norm"] for m in one) > 1.0


class _StopAt(Callback):
    """Records every hook it sees; stops the run after step `at`."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen: list[tuple[str, Any]] = []

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.seen.append(("step", record["step"]))
        trainer.stop = record["step"] == self.at

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.seen.append(("eval", record["step"]))

    def before_save(self, trainer: Trainer) -> None:
        self.seen.append(("save", trainer.global_step))

    def on_end(self, trainer: Trainer, failed: bool) -> None:
        self.seen.append(("end", failed))


def test_a_callback_sees_every_seam_and_can_end_the_run(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """A feature added as a Callback (here: an early stop at step 3 of 6) gets each step's and
    evaluation's record in order; the run ends with its final evaluation and final save."""
    out = tmp_path / "out"
    cfg = {**base_cfg, "output_dir": str(out), "val_set_size": 6, "eval_steps": 2}
    stop = _StopAt(3)
    result = run_training(validate_cfg(cfg), [stop])  # one rank, in this process (gloo)
    assert stop.seen == [
        ("eval", 0),
        ("step", 1),
        ("save", 1),
        ("step", 2),
        ("eval", 2),
        ("save", 2),
        ("step", 3),
        ("eval", 3),  # the last step's evaluation
        ("save", 3),
        ("end", False),
    ]
    assert result.steps == 3 and [m["step"] for m in result.metrics] == [1, 2, 3]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2, 3]


def test_save_strategy_no_saves_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The shared 2-rank run `eager-10` (save_strategy: no): its 10 steps' metrics, and no
    checkpoint, no model weights, nothing being written; the log says the model is not saved."""
    run = shared_run(tmp_path_factory, "eager-10")
    assert [m["step"] for m in read_metrics(run.out)] == list(range(1, 11))
    names = sorted(p.name for p in run.out.iterdir())
    assert not [n for n in names if n.startswith("checkpoint-") or ".tmp" in n], names
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".index.json"))], names
    assert "config.json" in names and "metrics.jsonl" in names  # the run's other files
    assert "save_strategy: no: the trained model is not saved" in run.stderr


def test_save_strategy_decides_the_checkpoint_interval() -> None:
    """`epoch`: one checkpoint per epoch, as saves_per_epoch: 1; `steps` and null: save_steps;
    `no` and `epoch` refuse a save interval of their own."""
    from shardforge.train.loop import save_interval

    def every(**keys: Any) -> int | None:
        cfg = validate_cfg({"base_model": "unused", **keys})
        return save_interval(cfg, num_sequences=81, global_batch=12)  # 7 steps per epoch

    assert every(save_strategy="epoch") == every(saves_per_epoch=1) == 7
    assert every(save_strategy="steps", save_steps=3) == every(save_steps=3) == 3
    assert every(save_strategy="no") is None
    for keys in ({"save_steps": 3}, {"saves_per_epoch": 2}, {"merge_on_save": True}):
        with pytest.raises(
            Exception, match=f"save_strategy: no saves nothing, but {next(iter(keys))}"
        ):
            validate_cfg({"base_model": "unused", "save_strategy": "no", **keys})
    with pytest.raises(Exception, match="save_strategy: epoch saves once per epoch"):
        validate_cfg({"base_model": "unused", "save_strategy": "epoch", "save_steps": 3})
    with pytest.raises(Exception, match="save_strategy: keeping the checkpoint with the best"):
        validate_cfg({"base_model": "unused", "save_strategy": "best"}, command="train")
