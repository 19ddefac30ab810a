"""Optimizer and schedule tables."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.config import validate_cfg
from shardforge.train.optim import (
    DECAYS,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    scheduler_state,
    warmup_steps,
)


def _cfg(**extra: object):  # type: ignore[no-untyped-def]
    return validate_cfg({"base_model": "x", "learning_rate": 1.0, **extra})


def test_warmup_then_decay() -> None:
    assert [lr_multiplier(s, 3, 10, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multiplier(3, 3, 10, "cosine") == 1.0
    assert math.isclose(lr_multiplier(10, 3, 10, "cosine"), 0.0, abs_tol=1e-12)
    assert math.isclose(lr_multiplier(6, 2, 10, "linear"), 0.5)
    assert set(DECAYS) == {"cosine", "linear", "constant"}


def test_warmup_steps_from_ratio_or_steps() -> None:
    assert warmup_steps(_cfg(warmup_steps=4), 100) == 4
    assert warmup_steps(_cfg(warmup_ratio=0.03), 100) == 3
    assert warmup_steps(_cfg(), 100) == 0


@pytest.mark.parametrize("name,cls", [("adamw_torch", torch.optim.AdamW), ("sgd", torch.optim.SGD)])
def test_optimizer_table(name: str, cls: type) -> None:
    opt = build_optimizer([torch.nn.Parameter(torch.ones(2))], _cfg(optimizer=name))
    assert type(opt) is cls


def test_scheduler_state_round_trips_through_json() -> None:
    import json

    cfg = _cfg(warmup_steps=2, lr_scheduler="linear")
    opt = build_optimizer([torch.nn.Parameter(torch.ones(2))], cfg)
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(scheduler_state(sched)))
    opt2 = build_optimizer([torch.nn.Parameter(torch.ones(2))], cfg)
    sched2 = build_scheduler(opt2, cfg, 10)
    sched2.load_state_dict({**sched2.state_dict(), **state})
    opt2.step()
    opt.step()
    sched2.step()
    sched.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
