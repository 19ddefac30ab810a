"""The learning-rate schedule of a run, as Axolotl builds it (one table, no branches elsewhere).

transformers' schedules (`get_scheduler`: linear, cosine, constant, ...) are used as they are;
Axolotl's own are the `AXOLOTL` rows: cosine with a floor (`cosine_min_lr_ratio`), with a floor
reached early (`cosine_constant_lr_ratio`), with quadratic warmup (`lr_quadratic_warmup`), `rex`
and `one_cycle` (torch's OneCycleLR); `reduce_lr_on_plateau` is transformers' (torch's
ReduceLROnPlateau with `lr_scheduler_kwargs`, no warmup), stepped by each evaluation
(`best.Plateau`), not by the optimizer steps. Each row maps (optimizer step, warmup, total) to the
multiplier of each group's peak lr; a run whose total number of steps changed on resume continues
a cosine/linear/constant decay from where its checkpoint was (`Continuation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.config.schema import ShardforgeConfig

Multiplier = Callable[[int], float]

# schedule name -> multiplier of the peak lr after warmup, as a function of progress in [0, 1]
# (transformers' formulas; a resumed run with another total continues these)
DECAYS: dict[str, Callable[[float], float]] = {
    "cosine": lambda t: max(0.0, 0.5 * (1.0 + math.cos(math.pi * t))),
    "linear": lambda t: max(0.0, 1.0 - t),
    "constant": lambda t: 1.0,
}


def warmup_steps(cfg: ShardforgeConfig, total_steps: int) -> int:
    """Axolotl's warmup length: `warmup_steps` (a number below 1: that fraction of the steps,
    rounded up, as transformers reads it), else `warmup_ratio` x steps (rounded down), else 3% of
    the steps up to 100; a warmup of 1 step becomes 2."""
    if cfg.warmup_steps is not None and cfg.warmup_steps < 1 and cfg.warmup_steps != 0:
        return math.ceil(cfg.warmup_steps * total_steps)
    if cfg.warmup_steps is not None:
        steps = int(cfg.warmup_steps)
    elif cfg.warmup_ratio is not None:
        steps = int(cfg.warmup_ratio * total_steps)
    else:
        steps = min(int(0.03 * total_steps), 100)
    return 2 if steps == 1 else steps


def _linear_warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def lr_multiplier(step: int, warmup: int, total: int, decay: str) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup from 0, then
    the decay (transformers' linear, cosine; `constant` has no warmup, as in transformers)."""
    if decay == "constant":
        return 1.0
    if step < warmup:
        return _linear_warmup(step, warmup)
    return DECAYS[decay]((step - warmup) / max(1, total - warmup))


def _cosine_floor(step: int, warmup: int, total: int, floor: float, end: int) -> float:
    """Axolotl's cosine to `floor` x peak, reached at step `end` and held after it."""
    if step < warmup:
        return _linear_warmup(step, warmup)
    progress = (min(step, end) - warmup) / max(1, end - warmup)
    return max(0.0, (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))) + floor


def _quadratic(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return _linear_warmup(step, warmup) ** 2
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def _rex(step: int, warmup: int, total: int, floor: float) -> float:
    """Axolotl's RexLR at optimizer step `step` (it counts from 1)."""
    t = step + 1
    if 1 <= t <= warmup:
        return t / warmup
    after, remaining = t - warmup, total - warmup
    if after >= remaining or remaining <= 0:
        return floor
    z = (remaining - after) / remaining
    return floor + (1.0 - floor) * (z / (0.1 + 0.9 * z))


def axolotl_multiplier(cfg: ShardforgeConfig, warmup: int, total: int) -> Multiplier | None:
    """The multiplier of Axolotl's own schedule that `cfg` selects; None: transformers' own."""
    floor = cfg.cosine_min_lr_ratio or 0.0
    if cfg.lr_scheduler == "rex":
        return lambda s: _rex(s, warmup, total, floor)
    if cfg.lr_scheduler != "cosine":
        return None
    if cfg.lr_quadratic_warmup:
        return lambda s: _quadratic(s, warmup, total)
    if cfg.cosine_min_lr_ratio and cfg.cosine_constant_lr_ratio:
        end = int(total * cfg.cosine_constant_lr_ratio)
        return lambda s: _cosine_floor(s, warmup, total, floor, end)
    if cfg.cosine_min_lr_ratio:
        return lambda s: _cosine_floor(s, warmup, total, floor, total)
    return None


@dataclass(frozen=True)
class Continuation:
    """Where a resumed run whose total number of steps changed picks up the schedule."""

    start: int  # the step the checkpoint was saved at
    multiplier: float  # the multiplier of the peak lr the checkpoint reached (for step `start`)
    warmup: int  # the checkpoint's warmup length


def continues(cfg: ShardforgeConfig) -> bool:
    """A changed total continues the decay of the checkpoint (cosine, linear, constant without
    Axolotl's extras); any other schedule follows its curve over the new total."""
    return cfg.lr_scheduler in DECAYS and axolotl_multiplier(cfg, 0, 1) is None


def continuation(
    cfg: ShardforgeConfig, step: int, total_steps: int, scheduler: dict[str, Any]
) -> Continuation:
    """The Continuation of a checkpoint saved at `step` of a `total_steps` schedule whose
    scheduler state is `scheduler` (the lr it reached is the one its next step would use)."""
    last, base = scheduler.get("_last_lr"), scheduler.get("base_lrs")
    warmup = warmup_steps(cfg, total_steps)
    if last and base and base[0]:
        multiplier = float(last[0]) / float(base[0])
    else:
        multiplier = lr_multiplier(step, warmup, total_steps, cfg.lr_scheduler)
    return Continuation(step, multiplier, warmup)


def schedule(
    cfg: ShardforgeConfig, total_steps: int, resumed: Continuation | None = None
) -> Multiplier:
    """The lr multiplier of each (0-based) step of a cosine, linear or constant schedule.

    Without `resumed`: linear warmup, then the decay to step `total_steps`. With `resumed` (a
    checkpoint of a schedule with another total): the checkpoint's schedule up to its step, then
    the decay continues from the multiplier it reached over the new remaining steps (no second
    warmup), so the lr has no jump. A checkpoint saved during its warmup finishes that warmup
    first, then decays over the new total.
    """
    decay = cfg.lr_scheduler
    if resumed is None:
        warmup = warmup_steps(cfg, total_steps)
        return lambda s: lr_multiplier(s, warmup, total_steps, decay)
    if resumed.start < resumed.warmup:
        return lambda s: lr_multiplier(s, resumed.warmup, total_steps, decay)
    span = max(1, total_steps - resumed.start)
    return lambda s: resumed.multiplier * DECAYS[decay](min(1.0, max(0, s - resumed.start) / span))


def _one_cycle(
    optimizer: torch.optim.Optimizer, cfg: ShardforgeConfig, warmup: int, total: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """Axolotl's one_cycle: torch's OneCycleLR peaking at learning_rate after the warmup
    (cosine annealing; `lr_div_factor` is its div_factor; lr_scheduler_kwargs override)."""
    kwargs: dict[str, Any] = {"pct_start": warmup / total, "anneal_strategy": "cos"}
    if cfg.lr_div_factor is not None:
        kwargs["div_factor"] = cfg.lr_div_factor
    kwargs.update(cfg.lr_scheduler_kwargs or {})
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.learning_rate, total_steps=total, **kwargs
    )


def _plain_cosine(cfg: ShardforgeConfig, warmup: int, total: int) -> Multiplier | None:
    """The default schedule (cosine, no lr_scheduler_kwargs): transformers' cosine with warmup,
    bit for bit, without importing transformers.optimization (it imports peft, bitsandbytes
    and torch's inductor: seconds of start-up in every rank and launcher); None otherwise."""
    if cfg.lr_scheduler != "cosine" or cfg.lr_scheduler_kwargs:
        return None
    return lambda s: lr_multiplier(s, warmup, total, "cosine")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: ShardforgeConfig,
    total_steps: int,
    resumed: Continuation | None = None,
) -> torch.optim.lr_scheduler.LRScheduler:
    """The run's scheduler; stepped once per optimizer step (its lr is the next step's)."""
    warmup = warmup_steps(cfg, total_steps)
    if resumed is not None and continues(cfg):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg, total_steps, resumed))
    if cfg.lr_scheduler == "one_cycle":
        return _one_cycle(optimizer, cfg, warmup, total_steps)
    own = axolotl_multiplier(cfg, warmup, total_steps) or _plain_cosine(cfg, warmup, total_steps)
    if own is not None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, own)
    from transformers import get_scheduler

    return get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=dict(cfg.lr_scheduler_kwargs or {}),
    )


def schedule_problem(cfg: ShardforgeConfig) -> str | None:
    """Why the schedule of `cfg` cannot be built (e.g. an lr_scheduler_kwargs key it does not
    take), tried on a stand-in optimizer; None if it can."""
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.learning_rate)
    try:
        build_scheduler(probe, cfg, 100)
    except (TypeError, ValueError) as exc:
        return f"lr_scheduler {cfg.lr_scheduler}: {str(exc).splitlines()[0][:200]}"
    return None


def load_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, saved: dict[str, Any]) -> None:
    """A checkpoint's `scheduler_state` into `scheduler` (reduce_lr_on_plateau: also its lrs
    into the optimizer's groups, where that scheduler keeps them)."""
    scheduler.load_state_dict({**scheduler.state_dict(), **saved})
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and "_last_lr" in saved:
        for group, lr in zip(scheduler.optimizer.param_groups, saved["_last_lr"], strict=True):
            group["lr"] = lr


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The JSON-serialisable part of a scheduler's state (its step count and last lrs; an lr
    kept as a tensor, as torchao's optimizers keep it, as a float)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item()
        return [plain(v) for v in value] if isinstance(value, list) else value

    return {
        k: plain(v)
        for k, v in scheduler.state_dict().items()
        if isinstance(v, int | float | bool | list) and k != "lr_lambdas"
    }
