"""Optimizer and learning-rate schedule from the config (tables, not branches)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ShardforgeConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps(cfg, total_steps)
    decay = cfg.lr_scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, warmup, total_steps, decay)
    )


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The JSON-serialisable part of a scheduler's state (its step count and last lrs)."""
    return {
        k: v
        for k, v in scheduler.state_dict().items()
        if isinstance(v, int | float | bool | list) and k != "lr_lambdas"
    }
