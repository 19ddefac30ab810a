"""The optimizer from the config: one row of `OPTIMIZERS` per name, as transformers/Axolotl map
it (torchao's low-bit AdamW for adamw_torch_8bit/4bit, bitsandbytes' for adamw_bnb_8bit,
adamw_8bit, paged_adamw_8bit; torch's Muon with AdamW beside it for muon). The parameter groups
come from `optim_groups`, the schedule from `schedules`."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
import yaml

from shardforge.config.schema import ShardforgeConfig
from shardforge.config.schema_optim import PROJECTED
from shardforge.errors import ConfigError
from shardforge.train.optim_groups import Group, muon_split, param_groups
from shardforge.train.optim_lowbit import EagerOnCpu, LocalShards
from shardforge.train.optim_projected import FullMatrices, projected_groups, projection_settings

Build = Callable[[list[Group], ShardforgeConfig, dict[str, Any]], torch.optim.Optimizer]
QUANT_EXTRA = "pip install 'shardforge[quant]'"
LOWRANK_EXTRA = "pip install 'shardforge[lowrank]'"


def _adam_kwargs(cfg: ShardforgeConfig) -> dict[str, Any]:
    return {
        "lr": cfg.learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "eps": cfg.adam_epsilon,
        "weight_decay": cfg.weight_decay,
    }


def _adamw(fused: bool) -> Build:
    def build(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
        return torch.optim.AdamW(groups, **{**_adam_kwargs(cfg), "fused": fused or None, **extra})

    return build


def _sgd(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
    return torch.optim.SGD(
        groups, **{"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay, **extra}
    )


def _torchao_class(bits: int) -> type:
    from torchao.optim import AdamW4bit, AdamW8bit

    base = AdamW8bit if bits == 8 else AdamW4bit
    return type(base.__name__, (EagerOnCpu, base), {})


def _torchao(bits: int) -> Build:
    def build(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
        return _torchao_class(bits)(groups, **{**_adam_kwargs(cfg), **extra})

    return build


def _bnb_class(paged: bool) -> type:
    import bitsandbytes as bnb

    base = bnb.optim.PagedAdamW if paged else bnb.optim.AdamW
    return type(base.__name__ + "8bit", (LocalShards, base), {})


def _bnb(paged: bool) -> Build:
    def build(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
        return _bnb_class(paged)(groups, **{**_adam_kwargs(cfg), "optim_bits": 8, **extra})

    return build


def _muon_class() -> Any:
    return getattr(torch.optim, "Muon")  # noqa: B009 (torch >= 2.9)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon for the groups marked `muon`, AdamW for the others: one optimizer (one
    state, one list of groups) for the schedule and the checkpoint."""

    def __init__(self, groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]):
        muon: dict[str, Any] = {"lr": cfg.learning_rate, "weight_decay": cfg.weight_decay}
        muon |= {"adjust_lr_fn": "match_rms_adamw", **extra}
        super().__init__(groups, {})
        hidden = [g for g in self.param_groups if g["muon"]]
        rest = [g for g in self.param_groups if not g["muon"]]
        self.inner = [
            _muon_class()(hidden, **muon) if hidden else None,
            torch.optim.AdamW(rest, **_adam_kwargs(cfg)) if rest else None,
        ]
        self._link()

    def _link(self) -> None:
        """The inner optimizers use this one's groups and state."""
        for inner, muon in zip(self.inner, (True, False), strict=True):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g["muon"] is muon]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for inner in self.inner:
            if inner is not None:
                inner.step()
        return loss


def _muon(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
    return MuonWithAdamW(groups, cfg, extra)


def _projected_class(name: str) -> type:
    """galore-torch's / apollo-torch's optimizer of `name`, stepping under FSDP2 as
    `FullMatrices` does (Adafactor: every parameter on its full matrix)."""
    if name.startswith("apollo"):
        from apollo_torch import APOLLOAdamW as base
    elif name.startswith("galore_adafactor"):
        from galore_torch import GaLoreAdafactor as base
    elif name.startswith("galore_adamw_8bit"):
        from galore_torch import GaLoreAdamW8bit as base
    else:
        from galore_torch import GaLoreAdamW as base
    label = ("APOLLO" if name.startswith("apollo") else "GaLore") + base.__name__
    extra = {"full_all": "adafactor" in name, "syncs_cuda": "8bit" in name}
    return type(label, (FullMatrices, base), extra)


def _projected(name: str) -> Build:
    """transformers' kwargs: the lr (Adafactor: without its relative step and parameter scale);
    APOLLO's target group also takes adam_beta1/2 and adam_epsilon."""

    def build(groups: list[Group], cfg: ShardforgeConfig, extra: dict[str, Any]) -> Any:
        kwargs: dict[str, Any] = {"lr": cfg.learning_rate}
        if name == "galore_adafactor":
            kwargs |= {"scale_parameter": False, "relative_step": False}
        elif name == "galore_adamw":
            kwargs["no_deprecation_warning"] = True
        elif name == "apollo_adamw":
            groups[1] |= {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_epsilon}
        return _projected_class(name)(groups, **kwargs)

    return build


# name -> (build, the package it needs or None, where its keyword arguments are checked)
OPTIMIZERS: dict[str, tuple[Build, str | None, Callable[[], Any]]] = {
    "adamw_torch": (_adamw(False), None, lambda: torch.optim.AdamW),
    "adamw_torch_fused": (_adamw(True), None, lambda: torch.optim.AdamW),
    "sgd": (_sgd, None, lambda: torch.optim.SGD),
    "adamw_torch_8bit": (_torchao(8), "torchao", lambda: _torchao_class(8)),
    "adamw_torch_4bit": (_torchao(4), "torchao", lambda: _torchao_class(4)),
    "adamw_bnb_8bit": (_bnb(False), "bitsandbytes", lambda: _bnb_class(False)),
    "adamw_8bit": (_bnb(False), "bitsandbytes", lambda: _bnb_class(False)),
    "paged_adamw_8bit": (_bnb(True), "bitsandbytes", lambda: _bnb_class(True)),
    "muon": (_muon, None, lambda: _muon_class()),
    "galore_adamw": (_projected("galore_adamw"), "galore_torch", lambda: None),
    "galore_adafactor": (_projected("galore_adafactor"), "galore_torch", lambda: None),
    "galore_adamw_8bit": (_projected("galore_adamw_8bit"), "galore_torch", lambda: None),
    "apollo_adamw": (_projected("apollo_adamw"), "apollo_torch", lambda: None),
}
# refused, and why (one line each)
_LAYERWISE = (
    "steps each parameter in a gradient hook during backward, before FSDP2 has reduced its "
    "gradient over the ranks (transformers refuses it with DDP/FSDP too); use {base}"
)
REFUSED = {
    name: _LAYERWISE.format(base=name.removesuffix("_layerwise"))
    for name in PROJECTED
    if name.endswith("_layerwise")
}


def optim_args(cfg: ShardforgeConfig) -> dict[str, Any]:
    """`optim_args` as keyword arguments: a mapping, or 'key=value,...' (values read as YAML
    scalars, so numbers and booleans keep their type)."""
    if not cfg.optim_args:
        return {}
    if isinstance(cfg.optim_args, dict):
        return dict(cfg.optim_args)
    pairs = [item.split("=", 1) for item in cfg.optim_args.replace(" ", "").split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError("expected 'key=value,key=value'")
    return {key: yaml.safe_load(value) for key, value in pairs}


def optimizer_problem(cfg: ShardforgeConfig) -> tuple[str, str] | None:
    """(key, why) when the optimizer cannot be built here: its package or torch version is
    missing, or an optim_args key it does not take."""
    if cfg.optimizer in REFUSED:
        return "optimizer", f"{cfg.optimizer}: {REFUSED[cfg.optimizer]}"
    _, package, cls = OPTIMIZERS[cfg.optimizer]
    if package is not None and importlib.util.find_spec(package) is None:
        extra_name = LOWRANK_EXTRA if cfg.optimizer in PROJECTED else QUANT_EXTRA
        return "optimizer", f"{cfg.optimizer} needs {package}: {extra_name}"
    if cfg.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        return (
            "optimizer",
            f"muon needs torch.optim.Muon (torch >= 2.9; this is {torch.__version__})",
        )
    try:
        extra = optim_args(cfg)
        if cfg.optimizer in PROJECTED:
            projection_settings(cfg.optimizer, extra)
            return None
    except ValueError as exc:
        return "optim_args", str(exc)
    taken = inspect.signature(cls()).parameters
    unknown = sorted(set(extra) - set(taken))
    if unknown:
        return "optim_args", f"{cfg.optimizer} takes no argument {', '.join(map(repr, unknown))}"
    return None


def build_optimizer(model: torch.nn.Module, cfg: ShardforgeConfig) -> torch.optim.Optimizer:
    """The optimizer of `model`'s trainable parameters, grouped as `cfg` asks."""
    build = OPTIMIZERS[cfg.optimizer][0]
    if cfg.optimizer in PROJECTED:
        assert cfg.optim_target_modules is not None  # the schema's check
        settings = projection_settings(cfg.optimizer, optim_args(cfg))
        try:
            groups = projected_groups(model, cfg.optim_target_modules, settings)
        except ValueError as exc:
            raise ConfigError("optim_target_modules", [str(exc)]) from None
        return build(groups, cfg, {})
    groups = param_groups(model, cfg)
    if cfg.optimizer == "muon":
        groups = muon_split(model, groups)
    return build(groups, cfg, optim_args(cfg))
