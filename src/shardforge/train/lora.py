"""LoRA training: peft adapters injected into the meta-device model before FSDP2 shards it.

    add_lora(model, cfg)              peft's LoRA layers inside the HF model (names kept; the base
                                      frozen, the adapter and `lora_modules_to_save` trainable)
    lora_weights(model, base, cfg)    the full state dict to load: base weights under the
                                      adapted names, the adapter initialised (or from
                                      lora_model_dir)
    save_adapter(out, model, cfg)     the PEFT adapter directory (`PeftModel.from_pretrained`)

The adapter is injected with `peft.inject_adapter_in_model`, so the model keeps its class and
its parameter names; each base weight a LoRA layer wraps becomes `<module>.base_layer.weight`
and the adapter `<module>.lora_A.default.weight` / `lora_B`. Frozen base weights and the
trainable adapter of one transformer block sit in the same FSDP unit. Initial adapter values
are computed on rank 0 from `seed` alone and broadcast, so every world size starts from the
same adapter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.config.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config_json,
    linear_layer_names,
    lora_config,
)
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.io.publish import follow_umask

log = logging.getLogger("shardforge")

ADAPTER = "default"  # peft's adapter name inside the model
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before every name

# segments peft inserts into a wrapped module's parameter names -> the base model's name
_BASE_SEGMENTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")
# adapter parameters: (kind, module) from a model key
_ADAPTER_KEY = re.compile(rf"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.{ADAPTER}\.weight$")


def _ties_embeddings(model: nn.Module) -> bool:
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def _peft_config(model: nn.Module, cfg: ShardforgeConfig) -> Any:
    """The LoraConfig training injects and saves (the merge writes the same one)."""
    return lora_config(cfg, cfg.base_model, _ties_embeddings(model), linear_layer_names(model))


def add_lora(model: nn.Module, cfg: ShardforgeConfig) -> Any:
    """Inject the LoRA adapter into `model` (in place, still on the meta device); return the
    peft config. A target that matches no module is a ConfigError naming the key."""
    from peft import inject_adapter_in_model

    config = _peft_config(model, cfg)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or ["no module matched"])[0][:200]
        key = "lora_target_modules" if cfg.lora_target_modules else "lora_target_linear"
        if cfg.lora_target_parameters and ("Param" in first or key not in cfg.model_fields_set):
            key = "lora_target_parameters"
        raise ConfigError(key, [f"peft cannot add the adapter: {first}"]) from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.2f%%)",
        cfg.lora_r,
        cfg.lora_alpha,
        ", ".join(sorted({*config.target_modules, *(config.target_parameters or ())}))
        if not isinstance(config.target_modules, str)
        else config.target_modules,
        trainable,
        total,
        100 * trainable / max(total, 1),
    )
    return config


def prepare_lora(model: nn.Module, cfg: ShardforgeConfig, is_main: bool) -> dict[str, torch.Tensor]:
    """Inject the adapter into the meta-device `model`; on the main rank return the full state
    dict to load into it (base weights read before the names change), elsewhere {}."""
    from shardforge.train.model import read_full_state_dict

    base = read_full_state_dict(cfg.base_model, model) if is_main else {}
    add_lora(model, cfg)
    return lora_weights(model, base, cfg) if is_main else {}


def base_key(key: str) -> str | None:
    """The base model's name of an adapted model's state-dict key; None for adapter weights."""
    if _ADAPTER_KEY.match(key):
        return None
    return _BASE_SEGMENTS.sub("", key)


def _adapter_init(shape: torch.Size, kind: str, generator: torch.Generator) -> torch.Tensor:
    """peft's default init: A like nn.Linear (kaiming uniform, a=sqrt(5)), B zeros."""
    if kind == "lora_B":
        return torch.zeros(shape)
    fan_in = shape[1]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on a (r, fan_in) matrix
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def lora_weights(
    model: nn.Module, base: dict[str, torch.Tensor], cfg: ShardforgeConfig
) -> dict[str, torch.Tensor]:
    """The full state dict of the adapted `model` (rank 0): every base weight under its
    adapted name (a trained copy of a `lora_modules_to_save` module starts as the base), the
    adapter from `lora_model_dir` or initialised from `seed`."""
    start = read_adapter(Path(cfg.lora_model_dir)) if cfg.lora_model_dir else None
    generator = torch.Generator().manual_seed(cfg.seed)
    out: dict[str, torch.Tensor] = {}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    missing: list[str] = []
    for key in sorted(shapes):
        name = base_key(key)
        if name is None:
            kind = _ADAPTER_KEY.match(key)
            assert kind is not None  # base_key returns None only for adapter keys
            if start is None:
                out[key] = _adapter_init(shapes[key], kind["kind"], generator)
            elif key in start:
                out[key] = start[key]
            else:
                missing.append(key)
        elif start is not None and key in start:  # a trained lora_modules_to_save copy
            out[key] = start[key]
        else:
            out[key] = base[name]
    if missing:
        raise ConfigError(
            "lora_model_dir",
            [f"{cfg.lora_model_dir} lacks adapter weights for {', '.join(missing[:5])}"],
        )
    for key, tensor in out.items():
        if tuple(tensor.shape) != tuple(shapes[key]):
            raise ConfigError(
                "lora_model_dir" if start is not None else "base_model",
                [f"{key}: shape {list(tensor.shape)}, the model has {list(shapes[key])}"],
            )
    return out


def _model_key(saved: str) -> str:
    """An adapter file's name (as PeftModel.save_pretrained writes it) -> our model key."""
    name = saved.removeprefix(PEFT_PREFIX)
    m = re.match(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$", name)
    if m:
        return f"{m['module']}.{m['kind']}.{ADAPTER}.weight"
    module, _, leaf = name.rpartition(".")
    return f"{module}.modules_to_save.{ADAPTER}.{leaf}"


def read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter directory under our model keys (safetensors only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        hint = (
            " (adapter_model.bin is a pickle: convert it to safetensors)"
            if ("adapter_model.bin" in found)
            else ""
        )
        raise ConfigError(
            "lora_model_dir", [f"{directory}: no {ADAPTER_WEIGHTS}{hint}; found {found[:8]}"]
        )
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ConfigError("lora_model_dir", [f"{weights}: unreadable ({exc})"]) from None
    return {_model_key(k): v.to(torch.float32) for k, v in tensors.items()}


def save_adapter(output_dir: Path, model: nn.Module, cfg: ShardforgeConfig) -> None:
    """Write the PEFT adapter directory files into `output_dir` (rank 0 writes; every rank
    takes part in gathering the full adapter): adapter_model.safetensors, adapter_config.json."""
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    if dist.get_rank() != 0:
        return
    saved = get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER)
    # tied trained embeddings come back as one tensor under two names; peft stores both
    tensors = {PEFT_PREFIX + k: v.detach().clone().contiguous() for k, v in saved.items()}
    config = adapter_config_json(_peft_config(model, cfg))
    tmp = output_dir / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    follow_umask(tmp)  # save_file makes it rw-------
    os.replace(tmp, output_dir / ADAPTER_WEIGHTS)
    tmp_config = output_dir / f".{ADAPTER_CONFIG}.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(tmp_config, output_dir / ADAPTER_CONFIG)
    log.info("saved the LoRA adapter (%d tensors) to %s", len(tensors), output_dir)
