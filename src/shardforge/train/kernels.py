"""Axolotl's kernel plugins (`plugins:`), applied to the meta-device model before it is sharded.

    apply_kernels(model, cfg, announce)   the kernels that run here; one notice for the rest

LigerPlugin with its `liger_*` keys: liger-kernel's `_apply_liger_kernel_to_instance` patches
the model's modules (rope, RMSNorm, LayerNorm, SwiGLU/GeGLU; never its forward or loss: the loss
is shardforge's, `train.loss`), and `liger_fused_linear_cross_entropy` / `liger_cross_entropy`
become the loss's kernel. CutCrossEntropyPlugin (`cut_cross_entropy`, on by default with the
plugin): cut-cross-entropy's `linear_cross_entropy` is the loss's kernel. KernelsPlugin /
`use_kernels`: transformers' `set_use_kernels(True)`. Each needs CUDA and its package (the
`kernels` extra); where one cannot run, the run goes on with the same math and ONE notice line
names what runs instead: the model's own modules, and for a fused loss the chunked
cross-entropy (`train.loss`), which has the same aim (no full logits).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.config.schema_train import PLUGINS
from shardforge.errors import ConfigError
from shardforge.train.data import IGNORE_INDEX
from shardforge.train.loss import FusedLoss, not_exact, use_fused_loss

log = logging.getLogger("shardforge")

LIGER, CCE, HUB = list(PLUGINS)
# liger key -> the keywords of liger's apply functions it sets (each takes those it has)
_LIGER_MODULES = {
    "liger_rope": ("rope",),
    "liger_rms_norm": ("rms_norm",),
    "liger_layer_norm": ("layer_norm",),
    "liger_glu_activation": ("swiglu", "geglu"),
    "liger_swiglu": ("swiglu", "geglu"),
}
_PACKAGES = {"liger": "liger-kernel", "cce": "cut-cross-entropy", "hub": "kernels"}
_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "hub": "kernels"}
_LOSS_NAMES = {
    "liger_flce": "Liger's fused linear cross-entropy",
    "liger_ce": "Liger's cross-entropy",
    "cce": "Cut Cross Entropy",
}


@dataclass(frozen=True)
class KernelPlan:
    """What the config asks for: liger's module keywords, the loss kernel, the hub kernels."""

    liger: dict[str, bool] = field(default_factory=dict)
    loss: str | None = None
    hub: bool = False


def plan(cfg: ShardforgeConfig) -> KernelPlan:
    """The kernels `cfg` asks for (as Axolotl reads the keys: the liger ones with LigerPlugin,
    cut_cross_entropy with CutCrossEntropyPlugin); two fused losses at once are refused."""
    plugins = set(cfg.plugins or [])
    liger: dict[str, bool] = {}
    losses = []
    if LIGER in plugins:
        for key, words in _LIGER_MODULES.items():
            if getattr(cfg, key):
                liger.update(dict.fromkeys(words, True))
        if cfg.liger_fused_linear_cross_entropy:
            losses.append("liger_flce")
        if cfg.liger_cross_entropy:
            losses.append("liger_ce")
    if CCE in plugins and cfg.cut_cross_entropy is not False:
        losses.append("cce")
    if len(losses) > 1:
        names = " and ".join(_LOSS_NAMES[x] for x in losses)
        raise ConfigError("plugins", [f"{names} are two losses; keep one"])
    hub = bool(cfg.use_kernels)
    return KernelPlan(liger, losses[0] if losses else None, hub)


def missing(kind: str) -> str | None:
    """Why the kernels of `kind` (liger, cce, hub) cannot run here; None: they can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec(_MODULES[kind]) is None:
        return f"{_PACKAGES[kind]} is not installed (pip install 'shardforge[kernels]')"
    return None


def apply_kernels(model: nn.Module, cfg: ShardforgeConfig, announce: bool = True) -> KernelPlan:
    """Apply what runs here to the (meta-device, unsharded) `model`; one notice line (where
    `announce`) for every kernel that cannot run and what runs in its place."""
    wanted = plan(cfg)
    instead: list[str] = []
    if wanted.liger:
        if (why := missing("liger")) is None:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            flags = {"cross_entropy": False, "fused_linear_cross_entropy": False}
            _apply_liger_kernel_to_instance(model=model, **wanted.liger, **flags)
        else:
            names = ", ".join(sorted(k for k in wanted.liger if k != "geglu"))
            instead.append(f"Liger's {names}: {why}; the model's own modules run instead")
    if wanted.loss is not None:
        instead += _use_loss_kernel(model, wanted.loss)
    if wanted.hub:
        if (why := missing("hub")) is None:
            model.set_use_kernels(True)  # type: ignore[operator]
        else:
            instead.append(f"hub kernels (use_kernels): {why}; the model's own modules run instead")
    if instead and announce:
        log.warning("notice: kernels: %s", "; ".join(instead))
    return wanted


def _use_loss_kernel(model: nn.Module, kind: str) -> list[str]:
    """Make `kind` the loss's kernel where it runs; else what runs instead."""
    name = _LOSS_NAMES[kind]
    why = missing("cce" if kind == "cce" else "liger")
    head = getattr(model, "lm_head", None)
    if why is None and (problem := not_exact(model)) is not None:
        why = f"not exact for {type(model).__name__} ({problem})"
    elif why is None and not (type(head) is nn.Linear and head.bias is None):
        why = "the output head is not a plain Linear"
    if why is None:
        use_fused_loss(model, _loss_kernel(kind))
        return []
    return [f"{name}: {why}; the chunked cross-entropy (train/loss.py) runs instead"]


def _loss_kernel(kind: str) -> FusedLoss:
    """The summed loss of hidden states [n, dim] through head weight [vocab, dim] against
    targets [n] (IGNORE_INDEX counts nothing), by the package's own function."""
    fn: Callable[..., Any] = _package_loss(kind)
    if kind == "cce":

        def cce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
            return fn(hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction="sum")

        return cce
    if kind == "liger_flce":

        def flce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
            return fn(hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction="sum")

        return flce

    def ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> Any:
        logits = hidden @ weight.t()
        return fn(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")

    return ce


def _package_loss(kind: str) -> Callable[..., Any]:
    """The package's loss function for `kind`."""
    if kind == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy
    from liger_kernel.transformers import functional

    name = "liger_fused_linear_cross_entropy" if kind == "liger_flce" else "liger_cross_entropy"
    return getattr(functional, name)
