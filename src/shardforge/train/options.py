"""The training options that change the model around sharding, as Axolotl applies them.

determinism(cfg)                 full_determinism: deterministic algorithms only
before_shard(model, cfg)         qat, fp8, unfrozen_parameters, bfloat16 / float16 (the
                                 meta model); the frozen row ranges
after_load(model, cfg, ...)      the loaded weights' embedding rows (mean_resizing_embeddings
                                 false, fix_untrained_tokens); NEFTune's hook
QatDelay                         qat.fake_quant_after_n_steps (a loop callback)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train.freeze import RowFreezer, freeze_except
from shardforge.train.hooks import Callback
from shardforge.train.precision import (
    apply_fp8,
    apply_qat,
    cast_weights,
    fake_quant_on,
    set_fake_quant,
)

# the trainer (`loop.Trainer`), untyped here: the loop imports this module
Trainer = Any

log = logging.getLogger("shardforge")

UNTRAINED_EPS = 1e-16  # a row whose largest value is at most this was never trained


def determinism(cfg: ShardforgeConfig) -> None:
    """full_determinism, as transformers' enable_full_determinism: deterministic algorithms
    only (an op without one raises), cuDNN deterministic, cuBLAS' fixed workspace."""
    if not cfg.full_determinism:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def before_lora(model: nn.Module, cfg: ShardforgeConfig, announce: bool = True) -> None:
    """qat, on the meta model before LoRA (as Axolotl: the adapter's own layers are not
    fake-quantized; PEFT wraps the fake-quantized linear layers, nn.Linear subclasses)."""
    apply_qat(model, cfg, announce)


def before_shard(
    model: nn.Module, cfg: ShardforgeConfig, announce: bool = True
) -> dict[str, list[tuple[int, int]]]:
    """The options applied to the meta model before FSDP2 shards it (after LoRA); returns the
    row ranges unfrozen_parameters leaves frozen."""
    if cfg.unfrozen_parameters and cfg.adapter:
        raise ConfigError(
            "unfrozen_parameters",
            ["does not combine with a LoRA adapter here; use lora_modules_to_save"],
        )
    apply_fp8(model, cfg, announce)
    rows = freeze_except(model, cfg.unfrozen_parameters) if cfg.unfrozen_parameters else {}
    cast_weights(model, cfg, announce)
    return rows


def after_load(
    model: nn.Module,
    cfg: ShardforgeConfig,
    frozen_rows: dict[str, list[tuple[int, int]]],
    base_rows: int,
    data_ids: Callable[[], set[int]],
) -> Callable[[], None] | None:
    """The options applied once the sharded model holds its weights; returns what runs after
    each backward (unfrozen_parameters' frozen rows), if anything."""
    if cfg.mean_resizing_embeddings is False:
        _normal_rows(model, base_rows, cfg.seed)
    if cfg.fix_untrained_tokens not in (None, False):
        wanted = cfg.fix_untrained_tokens
        ids = data_ids() if wanted is True else set(_as_list(wanted))
        _fix_untrained(model, ids)
    if cfg.neftune_noise_alpha:
        model.get_input_embeddings().register_forward_hook(  # type: ignore[operator]
            _neftune_hook(cfg.neftune_noise_alpha)
        )
    return RowFreezer(model, frozen_rows) if frozen_rows else None


def _as_list(value: Any) -> list[int]:
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _neftune_hook(alpha: float) -> Callable[..., torch.Tensor]:
    """NEFTune (as transformers' neftune_post_forward_hook): in training, uniform noise of
    magnitude alpha / sqrt(sequence length x hidden size) on the input embeddings."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = alpha / math.sqrt(output.size(1) * output.size(2))
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return hook


def _embedding_params(model: nn.Module) -> list[torch.Tensor]:
    """The input and output embedding matrices (one when tied)."""
    out: list[torch.Tensor] = []
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # type: ignore[operator]
        weight = getattr(module, "weight", None)
        if weight is not None and all(weight is not w for w in out):
            out.append(weight)
    return out


@torch.no_grad()
def _edit_full(param: torch.Tensor, edit: Callable[[torch.Tensor], None]) -> None:
    """Apply `edit` to the full tensor of `param` (gathered when sharded) and keep this rank's
    part of the result. Every rank calls this (the gather is a collective)."""
    from shardforge.train.freeze import local_rows

    full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach().clone()
    edit(full)
    local = param.to_local() if hasattr(param, "to_local") else param
    first, count = local_rows(param)
    local.copy_(full[first : first + count].to(local.device, local.dtype))


def _normal_rows(model: nn.Module, base_rows: int, seed: int) -> None:
    """mean_resizing_embeddings: false: the rows the base lacked drawn from N(0, the config's
    initializer_range), as transformers' _init_weights (seeded: the same on every rank)."""
    std = float(getattr(model.config, "initializer_range", 0.02))

    def draw(full: torch.Tensor) -> None:
        extra = full.shape[0] - base_rows
        if extra > 0:
            gen = torch.Generator().manual_seed(seed)
            rows = torch.randn((extra, *full.shape[1:]), generator=gen) * std
            full[base_rows:] = rows.to(full.dtype)

    for param in _embedding_params(model):
        _edit_full(param, draw)


def _fix_untrained(model: nn.Module, ids: set[int]) -> None:
    """fix_untrained_tokens: the rows of `ids` whose input embedding was never trained (its
    largest value at most 1e-16) become the mean of the trained rows, input and output."""
    params = _embedding_params(model)
    embed = params[0]
    full = embed.full_tensor() if hasattr(embed, "full_tensor") else embed.detach()
    untrained = torch.amax(full.float(), dim=1) <= UNTRAINED_EPS
    fix = sorted(i for i in ids if 0 <= i < len(untrained) and untrained[i])
    if not fix:
        return
    log.info("fix_untrained_tokens: %d untrained token row(s) set to the mean", len(fix))

    def set_mean(matrix: torch.Tensor) -> None:
        trained = matrix[: len(untrained)][~untrained].float()
        matrix[fix] = trained.mean(dim=0).to(matrix.dtype)

    for param in params:
        _edit_full(param, set_mean)


class QatDelay(Callback):
    """qat.fake_quant_after_n_steps: fake quantization off for the first steps, then on (also
    after a resume, from the step resumed at)."""

    def __init__(self, trainer: Trainer) -> None:
        set_fake_quant(trainer.model, fake_quant_on(trainer.cfg, trainer.global_step))

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        set_fake_quant(trainer.model, fake_quant_on(trainer.cfg, trainer.global_step))
