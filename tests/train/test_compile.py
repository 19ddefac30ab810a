"""torch_compile: each block compiled in place under FSDP2, the eager run's losses, compiled in the
first step and never again."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import losses, read_metrics, shared_run

from shardforge.config import validate_cfg
from shardforge.train.compile import compile_kwargs, compiled_graphs
from shardforge.train.loop import Callback, Trainer, run_training

# fp32 on CPU. aot_eager traces the blocks (forward and backward graphs) but runs the traced
# ops as they are: measured identical to eager; inductor (not used here: its C++ compile took
# 105 s cold on this 2-core test machine) also matched eager to every printed digit
RTOL = 1e-4


def test_compile_settings_reach_module_compile() -> None:
    cfg = validate_cfg({"base_model": "unused", "torch_compile": True})
    assert compile_kwargs(cfg) == {"backend": "inductor"}
    cfg = validate_cfg(
        {
            "base_model": "unused",
            "torch_compile": "auto",
            "torch_compile_backend": "aot_eager",
            "torch_compile_mode": "max-autotune",
        }
    )
    assert compile_kwargs(cfg) == {"backend": "aot_eager", "mode": "max-autotune"}
    options = {"base_model": "unused", "torch_compile_options": {"max_autotune": True}}
    assert compile_kwargs(validate_cfg(options))["options"] == {"max_autotune": True}
    with pytest.raises(Exception, match="torch_compile_mode and torch_compile_options"):
        validate_cfg({**options, "torch_compile_mode": "default"})


@pytest.mark.slow
def test_a_compiled_run_on_two_ranks_has_the_eager_losses(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The shared 2-rank runs `eager-10` and `compiled-10` (gloo, packed, 10 steps)."""
    eager = shared_run(tmp_path_factory, "eager-10")
    compiled = shared_run(tmp_path_factory, "compiled-10")
    want, got = losses(eager.out), losses(compiled.out)
    assert list(got) == list(want) == list(range(1, 11))
    for step, loss in want.items():
        assert math.isclose(got[step], loss, rel_tol=RTOL), (step, got[step], loss)
    lines = compiled.stderr.splitlines()
    assert [line for line in lines if "compiled in place" in line] == [
        "torch.compile: 2 transformer blocks compiled in place (backend=aot_eager)"
    ]
    assert len([line for line in lines if "s compiling" in line]) == 1  # once, after step 1
    assert "more graph" not in compiled.stderr
    assert "torch.compile" not in eager.stderr


class _Graphs(Callback):
    """The graphs torch.compile made in each training step (not counting evaluations), and
    the blocks of the model."""

    def __init__(self) -> None:
        self.last = compiled_graphs()
        self.per_step: list[int] = []
        self.in_evaluations = 0
        self.blocks: list[Any] = []
        self.positions: Any = None

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.positions = trainer.seqs.position_ids
        now = compiled_graphs()
        self.per_step.append(now - self.last)
        self.last = now
        self.blocks = list(trainer.model.model.layers)  # type: ignore[union-attr,arg-type]

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        now = compiled_graphs()
        self.in_evaluations += now - self.last
        self.last = now


@pytest.mark.slow
def test_blocks_compile_in_the_first_step_and_never_again(
    base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One rank in this process: packed windows, 4 steps, evaluations between them (which
    compile graphs of their own, in eval mode). Every graph of the training steps is made in
    the first step; the blocks are still the model's own modules, sharded by FSDP2.

    Windows of 96 tokens: each holds several samples or padding. (A micro-batch whose windows
    each hold one sample filling it has no packing for transformers to detect: sdpa then runs
    without a mask, and the blocks compile that variant once more, with a warning.)"""
    import torch
    from torch.distributed.fsdp import FSDPModule

    cfg = {
        **base_cfg,
        "output_dir": str(tmp_path / "out"),
        "sequence_len": 96,
        "max_steps": 4,
        "save_steps": None,
        "save_strategy": "no",
        "val_set_size": 6,
        "eval_steps": 2,
        "torch_compile": True,
        "torch_compile_backend": "aot_eager",
    }
    graphs = _Graphs()
    try:
        with caplog.at_level(logging.INFO, logger="shardforge"):
            run_training(validate_cfg(cfg), [graphs])
    finally:
        torch._dynamo.reset()  # the compiled graphs go with this test
    restarts = graphs.positions[:, 1:] == 0
    assert bool(restarts.any(dim=1).all())  # every window: two samples, or one and padding
    # the old code ignored torch_compile: no graph at all
    assert graphs.per_step[0] > 0 and graphs.per_step[1:] == [0, 0, 0], graphs.per_step
    assert graphs.in_evaluations > 0  # eval mode, no grad: graphs of their own, made once
    for block in graphs.blocks:
        assert type(block).__name__ == "FSDPLlamaDecoderLayer" and isinstance(block, FSDPModule)
        assert block._compiled_call_impl is not None  # compiled in place
        assert all("_orig_mod" not in name for name, _ in block.named_parameters())
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "s compiling" in m and "first step" in m]) == 1
    said = [m for m in messages if m.startswith("torch.compile: compiling")]
    assert said == [  # before the silence of each first compile (aot_eager: no estimate)
        "torch.compile: compiling the transformer blocks for evaluation (first one)",  # at start
        "torch.compile: compiling the transformer blocks (first step)",
    ]
    assert len([m for m in messages if "s compiling" in m and "first evaluation" in m]) == 1
    assert not [m for m in messages if "more graph" in m], messages
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2, 3, 4]


def test_a_step_that_compiles_again_is_warned_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch around each step: the compile time after the first step; graphs made by a
    later step (not by an evaluation between steps) are one warning, the first time only."""
    from shardforge.train import compile as compile_module
    from shardforge.train.runtime import Runtime

    made = iter([0, 5, 5, 5, 5, 7, 7, 9, 9, 9])  # before and after steps 1 to 5
    monkeypatch.setattr(compile_module, "compiled_graphs", lambda: next(made))
    monkeypatch.setattr(compile_module, "compile_seconds", lambda: 12.5)
    cfg = validate_cfg({"base_model": "unused", "torch_compile": True})
    watch = compile_module.CompileWatch.of(cfg, Runtime(0, 1, 0, torch.device("cpu")))
    with caplog.at_level(logging.INFO, logger="shardforge"):
        for step in range(1, 6):
            watch.before_step()
            watch.after_step(step)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "torch.compile: compiling the transformer blocks (first step; about 45 s on a CPU with "
        "inductor)",
        "torch.compile: 12.5 s compiling 5 graph(s) in the first step (later steps reuse them)",
        "warning: torch.compile compiled 2 more graph(s) at step 3 (a shape or value the compiled "
        "blocks depend on changed; TORCH_LOGS=recompiles says which)",
    ]


def test_the_first_evaluation_says_it_compiles_and_how_long(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from shardforge.train import compile as compile_module
    from shardforge.train.runtime import Runtime

    graphs, seconds = iter([5, 8]), iter([10.0, 13.5])
    monkeypatch.setattr(compile_module, "compiled_graphs", lambda: next(graphs))
    monkeypatch.setattr(compile_module, "compile_seconds", lambda: next(seconds))
    cfg = validate_cfg({"base_model": "unused", "torch_compile": True})
    watch = compile_module.CompileWatch.of(cfg, Runtime(0, 1, 0, torch.device("cuda")))
    with caplog.at_level(logging.INFO, logger="shardforge"):
        for _ in range(2):  # the second compiles nothing: nothing said, nothing read
            with watch.evaluation():
                pass
    assert [r.getMessage() for r in caplog.records] == [
        "torch.compile: compiling the transformer blocks for evaluation (first one)",
        "torch.compile: 3.5 s compiling 3 graph(s) in the first evaluation (later evaluations "
        "reuse them)",
    ]


def test_the_watch_reads_nothing_of_dynamo_unless_compiling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch_compile off, or torch._dynamo not importable: no counter is read."""
    import sys

    from shardforge.train import compile as compile_module
    from shardforge.train.runtime import Runtime

    def unread() -> int:
        raise AssertionError("torch._dynamo's counters read")

    monkeypatch.setattr(compile_module, "compiled_graphs", unread)
    monkeypatch.setattr(compile_module, "compile_seconds", unread)
    rt = Runtime(0, 1, 0, torch.device("cpu"))
    off = validate_cfg({"base_model": "unused"})
    on = validate_cfg({"base_model": "unused", "torch_compile": True})
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)  # not importable
    with caplog.at_level(logging.INFO, logger="shardforge"):
        for cfg in (off, on):
            watch = compile_module.CompileWatch.of(cfg, rt)
            assert not watch.active
            for step in (1, 2):
                watch.before_step()
                watch.after_step(step)
            with watch.evaluation():
                pass
    assert not caplog.records
