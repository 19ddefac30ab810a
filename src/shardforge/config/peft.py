"""The peft `LoraConfig` of a config's `adapter: lora` settings: what training injects and what
the merge writes as `adapter_config.json` (one function, so the two always agree)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardforge.config.schema import ShardforgeConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


# the parts of a peft-wrapped layer that are not layers of the model: the wrapped linear, the
# adapters (lora_A.<adapter>, ...) and a modules_to_save copy
_PEFT_PARTS = ("base_layer", "original_module", "modules_to_save")


def linear_layer_names(model: Any) -> list[str]:
    """The last name segment of every linear layer of `model` but its output layer: what
    `lora_target_linear` targets (peft's "all-linear"). A model with the adapter injected
    gives the same names: a LoRA layer counts as the linear layer it wraps, its parts not."""
    import torch.nn as nn

    output = model.get_output_embeddings()
    outputs = {name for name, m in model.named_modules() if m is output}
    found = set()
    for name, m in model.named_modules():
        parts = name.split(".")
        if any(p in _PEFT_PARTS or p.startswith("lora_") for p in parts):
            continue
        base = getattr(m, "base_layer", None)
        linear = isinstance(m, nn.Linear) or isinstance(base, nn.Linear)
        if linear and m is not output and base is not output and name not in outputs:
            found.add(parts[-1])
    return sorted(found)


def lora_config(
    cfg: ShardforgeConfig,
    base_model_path: str | None = None,
    tied: bool = False,
    linear_names: Iterable[str] = (),
) -> Any:
    """peft's `LoraConfig` (`tied`: the model ties its input and output embeddings, which then
    stay one trained matrix when both are in `lora_modules_to_save`; `linear_names`: the
    model's `linear_layer_names`, which `lora_target_linear` with extra names targets)."""
    from peft import LoraConfig

    given = cfg.lora_target_modules
    targets: list[str] | str
    if isinstance(given, str):  # a regular expression
        targets = given
    elif cfg.lora_target_linear and given:
        linear = set(linear_names)
        if not linear:
            raise ValueError("lora_target_linear with lora_target_modules needs linear_names")
        targets = sorted(linear | set(given))
    elif cfg.lora_target_linear and linear_names:
        # the linear layers by name, as Axolotl's find_all_linear_names gives them to peft:
        # peft's "all-linear" adds the fused experts and routers of a mixture-of-experts model
        # too (target_parameters), which Axolotl adapts only with lora_target_parameters
        targets = sorted(set(linear_names))
    elif cfg.lora_target_linear:
        targets = "all-linear"
    else:
        targets = list(given or [])
    params = cfg.lora_target_parameters
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        target_parameters=[params] if isinstance(params, str) else list(params or []) or None,
        modules_to_save=list(cfg.lora_modules_to_save) if cfg.lora_modules_to_save else None,
        use_rslora=cfg.peft_use_rslora,
        fan_in_fan_out=cfg.lora_fan_in_fan_out,
        rank_pattern=dict(cfg.lora_rank_pattern or {}),
        alpha_pattern=dict(cfg.lora_alpha_pattern or {}),
        layers_to_transform=list(cfg.peft_layers_to_transform)
        if cfg.peft_layers_to_transform is not None
        else None,
        layers_pattern=list(cfg.peft_layers_pattern) if cfg.peft_layers_pattern else None,
        bias="none",
        task_type="CAUSAL_LM",
        ensure_weight_tying=tied and bool(cfg.lora_modules_to_save),
        base_model_name_or_path=base_model_path,
    )


def adapter_config_json(config: Any) -> dict[str, Any]:
    """`config` (a peft config, inference mode) as peft writes it to adapter_config.json."""
    config.inference_mode = True
    with tempfile.TemporaryDirectory(prefix="shardforge-adapter-config.") as tmp:
        config.save_pretrained(tmp)
        data: dict[str, Any] = json.loads((Path(tmp) / ADAPTER_CONFIG).read_text())
    return data
