"""Optimizer and learning-rate schedule from the config (tables, not branches)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.config.schema import ShardforgeConfig


def _adamw(params: Iterable[Any], cfg: ShardforgeConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
    )


def _sgd(params: Iterable[Any], cfg: ShardforgeConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)


OPTIMIZERS: dict[str, Callable[[Iterable[Any], ShardforgeConfig], torch.optim.Optimizer]] = {
    "adamw_torch": lambda p, c: _adamw(p, c, fused=False),
    "adamw_torch_fused": lambda p, c: _adamw(p, c, fused=True),
    "sgd": _sgd,
}

# schedule name -> multiplier of the peak lr after warmup, as a function of progress in [0, 1]
DECAYS: dict[str, Callable[[float], float]] = {
    "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
    "linear": lambda t: 1.0 - t,
    "constant": lambda t: 1.0,
}


def build_optimizer(params: Iterable[Any], cfg: ShardforgeConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS[cfg.optimizer](params, cfg)


def warmup_steps(cfg: ShardforgeConfig, total_steps: int) -> int:
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    if cfg.warmup_ratio is not None:
        return math.ceil(cfg.warmup_ratio * total_steps)
    return 0


def lr_multiplier(step: int, warmup: int, total: int, decay: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(1, total - warmup)
    return DECAYS[decay](min(1.0, (step - warmup) / span))


@dataclass(frozen=True)
class Continuation:
    """Where a resumed run whose total number of steps changed picks up the schedule."""

    start: int  # the step the checkpoint was saved at
    multiplier: float  # the multiplier of the peak lr the checkpoint reached (for step `start`)
    warmup: int  # the checkpoint's warmup length


def continuation(
    cfg: ShardforgeConfig, step: int, total_steps: int, scheduler: dict[str, Any]
) -> Continuation:
    """The Continuation of a checkpoint saved at `step` of a `total_steps` schedule whose
    scheduler state is `scheduler` (the lr it reached is the one its next step would use)."""
    last, base = scheduler.get("_last_lr"), scheduler.get("base_lrs")
    if last and base and base[0]:
        multiplier = float(last[0]) / float(base[0])
    else:
        warmup = warmup_steps(cfg, total_steps)
        multiplier = lr_multiplier(step, warmup, total_steps, cfg.lr_scheduler)
    return Continuation(step, multiplier, warmup_steps(cfg, total_steps))


def schedule(
    cfg: ShardforgeConfig, total_steps: int, resumed: Continuation | None = None
) -> Callable[[int], float]:
    """The lr multiplier of each (0-based) step.

    Without `resumed`: linear warmup, then the configured decay to step `total_steps`. With
    `resumed` (a checkpoint of a schedule with another total): the checkpoint's schedule up to its
    step, then the decay continues from the multiplier it reached over the new remaining steps
    (no second warmup), so the lr has no jump. A checkpoint saved during its warmup finishes that
    warmup first, then decays over the new total.
    """
    decay = cfg.lr_scheduler
    if resumed is None:
        warmup = warmup_steps(cfg, total_steps)
        return lambda s: lr_multiplier(s, warmup, total_steps, decay)
    if resumed.start < resumed.warmup:
        return lambda s: lr_multiplier(s, resumed.warmup, total_steps, decay)
    span = max(1, total_steps - resumed.start)
    return lambda s: resumed.multiplier * DECAYS[decay](min(1.0, max(0, s - resumed.start) / span))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: ShardforgeConfig,
    total_steps: int,
    resumed: Continuation | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg, total_steps, resumed))


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The JSON-serialisable part of a scheduler's state (its step count and last lrs)."""
    return {
        k: v
        for k, v in scheduler.state_dict().items()
        if isinstance(v, int | float | bool | list) and k != "lr_lambdas"
    }
