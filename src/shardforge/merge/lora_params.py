"""A LoRA on parameters (peft's `ParamWrapper`, ``target_parameters``: the fused experts of a
mixture-of-experts model, ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj``), fused
into the tensors the base model is saved as (one per expert):

    settings = peft_settings(adapter.settings, adapter.config_data, config, trust_remote_code)
    names, params = split_param_pairs(adapter.names, settings, expected, source)
    by_name.update(fuse_params(by_name, params, adapter.tensors, expected))

peft on transformers 5 adapts the fused experts of a model whose experts transformers fuses
at load when `target_modules` names the per-expert linear layers (``gate_proj``, ``up_proj``,
``down_proj``): it rewrites the config to ``target_parameters`` (with rank and alpha doubled
for ``gate_up_proj``); `peft_settings` applies peft's own rewrite to the adapter's settings.
peft nests one wrapper per adapted parameter of a module, the first parameter the module
registers innermost (``experts.base_layer`` holds the LoRA of ``gate_up_proj``,
``experts`` that of ``down_proj``): `split_param_pairs` names each pair's parameter so.
Each saved tensor cut from an adapted parameter (transformers' reversed conversion:
`keymap.conversion.Slice`) is fused with the delta of its box only
(`formats.sources.FusedParamLoraSource`): memory is one expert's tensor, not the stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from shardforge.errors import CheckpointError, MergeError
from shardforge.formats.sources import FusedParamLoraSource, ParamLoraSpec, TensorSource
from shardforge.keymap.lora import BASE_LAYER, LoraNames, LoraPair
from shardforge.keymap.lora_settings import LoraSettings
from shardforge.merge.check import ExpectedModel

_WRAPPED = f".{BASE_LAYER}"


@dataclass(frozen=True)
class ParamLora:
    """One adapted parameter (in-memory name) and its factors."""

    param: str
    pair: LoraPair
    spec: ParamLoraSpec  # its box is the whole parameter


def peft_settings(
    settings: LoraSettings,
    data: Mapping[str, Any],
    config: Any,
    trust_remote_code: bool,
    source: str = "adapter_config.json",
) -> LoraSettings:
    """The settings as peft applies them to this architecture: peft's own
    `convert_peft_config_for_transformers` (transformers 5's fused MoE experts: per-expert
    linear names become ``target_parameters``); unchanged where peft has no such rewrite."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
        )
    except ImportError:  # transformers 4, or a peft without it: peft rewrites nothing either
        return settings
    targets = data.get("target_modules")
    try:
        peft_config = LoraConfig(
            r=settings.r,
            lora_alpha=settings.lora_alpha,  # type: ignore[arg-type]
            target_modules=targets,
            target_parameters=list(settings.target_parameters) or None,
            rank_pattern=dict(settings.rank_pattern),
            alpha_pattern=dict(settings.alpha_pattern),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: peft refuses its settings ({exc})"[:300]) from None
    model: Any = SimpleNamespace(config=config)  # a list of names needs the model type only
    if isinstance(targets, str) and _rewritten(config):  # a regex is resolved on the model
        model = _meta_model(config, trust_remote_code)
    convert_peft_config_for_transformers(peft_config, model, None)
    modules = peft_config.target_modules
    return dataclasses.replace(
        settings,
        target_modules=modules if isinstance(modules, str) or modules is None else tuple(modules),
        target_parameters=tuple(sorted(peft_config.target_parameters or ())),
        rank_pattern=tuple((k, int(v)) for k, v in (peft_config.rank_pattern or {}).items()),
        alpha_pattern=tuple((k, float(v)) for k, v in (peft_config.alpha_pattern or {}).items()),
    )


def _rewritten(config: Any) -> bool:
    """Whether transformers converts this model type's weights at load (peft's rewrite may
    then apply)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return get_checkpoint_conversion_mapping(getattr(config, "model_type", None)) is not None


def _meta_model(config: Any, trust_remote_code: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _wrapped_params(module: str, settings: LoraSettings, expected: ExpectedModel) -> list[str]:
    """The parameters of `module` (its own, in registration order) peft wraps."""
    own = [n for n in expected.shapes if n.rpartition(".")[0] == module]
    return [n for n in own if settings.targets_parameter(n)]


def _param_of(name: str, settings: LoraSettings, expected: ExpectedModel) -> str | None:
    """The parameter the LoRA pair of adapter module `name` adapts, or None where it is a
    module's LoRA: the wrappers of one module nest, its first wrapped parameter innermost."""
    module, depth = name, 0
    while module.endswith(_WRAPPED):
        module, depth = module[: -len(_WRAPPED)], depth + 1
    wrapped = _wrapped_params(module, settings, expected)
    if not wrapped:
        return None
    index = len(wrapped) - 1 - depth
    return wrapped[index] if index >= 0 else None


def _problems(
    param: str,
    pair: LoraPair,
    spec: ParamLoraSpec,
    r: int,
    expected: ExpectedModel,
    tensors: Mapping[str, TensorSource],
) -> list[str]:
    """What is wrong with the factors of a LoRA on `param` (A (E * r, in), B (out, E * r))."""
    shape = expected.shapes[param]
    if len(shape) not in (2, 3):
        return [f"{param}: a LoRA on a {len(shape)}-dimensional parameter is not fused"]
    rows, cols = shape[-2:]
    n_in, n_out = (rows, cols) if len(shape) == 3 and not spec.swapped else (cols, rows)
    stack = r * (spec.experts or 1)
    out = []
    for label, input_name, want in (("A", pair.a, (stack, n_in)), ("B", pair.b, (n_out, stack))):
        got = tuple(tensors[input_name].shape)
        if got != want:
            out.append(f"{param}: LoRA {label} is {list(got)}, expected {list(want)} (r={r})")
    return out


def split_param_pairs(
    names: LoraNames,
    settings: LoraSettings,
    expected: ExpectedModel,
    tensors: Mapping[str, TensorSource],
    source: str,
) -> tuple[LoraNames, list[ParamLora]]:
    """The adapter's names without its LoRAs on parameters, and those (checked: one
    MergeError lists every problem). `expected`: the architecture in memory."""
    kept: dict[str, LoraPair] = {}
    found: list[ParamLora] = []
    problems: list[str] = []
    for module, pair in names.pairs.items():
        param = _param_of(module, settings, expected) if not pair.embedding else None
        if param is None:
            kept[module] = pair
            continue
        shape = expected.shapes[param]
        owner = param.rpartition(".")[0]
        experts = shape[0] if len(shape) == 3 else None
        swapped = experts is not None and owner not in expected.transposed
        box = tuple((0, n) for n in shape)
        spec = ParamLoraSpec(settings.scale(param), experts, swapped, box)
        found_problems = _problems(param, pair, spec, settings.rank(param), expected, tensors)
        problems += found_problems
        if not found_problems:
            found.append(ParamLora(param, pair, spec))
    if problems:
        raise MergeError(
            f"the adapter does not fit the base model ({len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}); check base_model and lora_model_dir",
            [f"{source}: {p}" if i == 0 else p for i, p in enumerate(problems)],
        )
    return dataclasses.replace(names, pairs=kept), found


def _saved_boxes(param: str, expected: ExpectedModel) -> dict[str, tuple[tuple[int, int], ...]]:
    """Saved name -> the box of `param` it is; MergeError where transformers saves the
    parameter through a converter that does more than cut it."""
    whole = tuple((0, n) for n in expected.shapes[param])
    layout = expected.saved
    if layout is None:
        return {param: whole}
    renamed = [saved for saved, memory in layout.renamed.items() if memory == param]
    if renamed:
        return {renamed[0]: whole}
    group = layout.group_of().get(param)
    if group is None or group.slices is None:
        raise MergeError(
            f"{param}: adapted by the LoRA, and saved by a conversion of transformers that "
            "does more than cut it; merge-lora does not fuse a LoRA into it"
        )
    return {
        saved: tuple(zip(cut.offsets, cut.sizes, strict=True))
        for saved, cut in group.slices.items()
        if cut.source == param
    }


def fuse_params(
    by_name: Mapping[str, TensorSource],
    params: list[ParamLora],
    tensors: Mapping[str, TensorSource],
    expected: ExpectedModel,
) -> dict[str, TensorSource]:
    """The saved tensors the LoRAs on parameters change, each fused over its box (`by_name`:
    the output's sources by saved name, the base tensors among them)."""
    out: dict[str, TensorSource] = {}
    for p in params:
        a, b = tensors[p.pair.a], tensors[p.pair.b]
        for saved, box in _saved_boxes(p.param, expected).items():
            spec = dataclasses.replace(p.spec, box=box)
            out[saved] = FusedParamLoraSource(by_name[saved], a, b, spec)
    return out


__all__ = ["ParamLora", "fuse_params", "peft_settings", "split_param_pairs"]
