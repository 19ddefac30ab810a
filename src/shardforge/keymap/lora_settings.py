"""What the fuse of a LoRA adapter needs from its ``adapter_config.json``: `LoraSettings`.

The per-module scale (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA;
``rank_pattern`` and ``alpha_pattern`` per module, matched as peft matches them), which modules
are targeted, which are saved whole, and ``fan_in_fan_out``. Settings that change the
arithmetic in ways the fuse does not implement are refused with the feature's name. The tensor
names are `keymap.lora`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardforge.errors import CheckpointError, shown

PEFT_TYPE = "LORA"
# adapter_config.json keys whose value changes nothing the fuse computes (initialisation,
# training, bookkeeping)
IGNORED_KEYS: frozenset[str] = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        "init_lora_weights",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "qalora_group_size",
        "runtime_config",
    }
)
# keys the settings read
READ_KEYS: frozenset[str] = frozenset(
    {
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "target_parameters",
        "exclude_modules",
        "modules_to_save",
        "fan_in_fan_out",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "layers_pattern",
        "ensure_weight_tying",
    }
)
# keys of features the fuse does not implement -> (feature, the values that mean "off")
UNSUPPORTED_KEYS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "use_dora": ("DoRA (weight-decomposed LoRA)", (False, None)),
    "lora_bias": ("LoRA bias terms (lora_bias)", (False, None)),
    "bias": ("trained bias terms (bias other than 'none')", ("none", None)),
    "trainable_token_indices": ("trainable tokens (trainable_token_indices)", (None, [], {})),
    "layer_replication": ("layer replication", (None, [])),
    "megatron_config": ("Megatron parallel layers", (None, {})),
    "use_qalora": ("QA-LoRA", (False, None)),
    "alora_invocation_tokens": ("activated LoRA (aLoRA)", (None, [])),
    "arrow_config": ("Arrow routing", (None, {})),
    "use_bdlora": ("block-diagonal LoRA", (None, False)),
    "velora_config": ("VeLoRA", (None, {})),
    "monteclora_config": ("MonteCLoRA", (None, {})),
    "kasa_config": ("KaSA", (None, {})),
}
# the layer lists peft looks for when `layers_to_transform` is given without `layers_pattern`
LAYERS_PATTERNS: tuple[str, ...] = ("layers", "h", "block", "blocks", "layer")
# peft's target_modules shorthand for every linear layer except the output layer
ALL_LINEAR = "all-linear"


# --------------------------------------------------------------------------------- settings


def _match_module(module: str, entry: str) -> bool:
    """peft's rule for a list entry: the module's full name, or its last segments."""
    return module == entry or module.endswith("." + entry)


def _pattern_key(patterns: Iterable[str], module: str) -> str | None:
    """peft's `get_pattern_key`: the first pattern that matches the end of the module name."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            continue
    return None


@dataclass(frozen=True)
class LoraSettings:
    """What fusing needs from ``adapter_config.json`` (see the module docstring)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None
    # parameters adapted in place (peft's ParamWrapper: fused MoE experts), by name or suffix
    target_parameters: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()
    fan_in_fan_out: bool = False
    use_dora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] = ()
    ensure_weight_tying: bool = False  # modules_to_save of tied embeddings stay tied

    @classmethod
    def from_adapter_config(
        cls, data: Mapping[str, Any], source: str = "adapter_config.json"
    ) -> LoraSettings:
        """Read peft's ``adapter_config.json`` content; CheckpointError for a setting the fuse
        does not implement (DoRA, LoRA biases, ...) or a value of the wrong type."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{source}: not a JSON object")
        peft_type = data.get("peft_type", PEFT_TYPE)
        if peft_type != PEFT_TYPE:
            raise CheckpointError(
                f"{source}: peft_type {shown(peft_type)}: shardforge fuses LoRA adapters "
                f"({PEFT_TYPE}) only"
            )
        problems = []
        for key, (feature, off) in UNSUPPORTED_KEYS.items():
            value = data.get(key)
            if not any(type(value) is type(o) and value == o for o in off):
                problems.append(f"{key}: {shown(value, 60)} ({feature})")
        unknown = sorted(
            k for k in data if k not in IGNORED_KEYS | READ_KEYS and k not in UNSUPPORTED_KEYS
        )
        problems += [
            f"{k}: {shown(data[k], 60)} (a setting this shardforge does not know)"
            for k in unknown
            if data[k] not in (None, False, {}, [], "")
        ]
        if problems:
            raise CheckpointError(
                f"{source}: the adapter uses settings shardforge cannot fuse; merge it with "
                "peft's merge_and_unload instead",
                problems,
            )
        r = _number(data, "r", source, int)
        alpha = _number(data, "lora_alpha", source, float)
        return cls(
            r=int(r),
            lora_alpha=alpha,
            use_rslora=_flag(data, "use_rslora", source),
            target_modules=_names(data.get("target_modules"), "target_modules", source),
            target_parameters=_list(data.get("target_parameters"), "target_parameters", source),
            modules_to_save=_list(data.get("modules_to_save"), "modules_to_save", source),
            fan_in_fan_out=_flag(data, "fan_in_fan_out", source),
            use_dora=False,
            rank_pattern=_pattern(data.get("rank_pattern"), "rank_pattern", source, int),
            alpha_pattern=_pattern(data.get("alpha_pattern"), "alpha_pattern", source, float),
            exclude_modules=_names(data.get("exclude_modules"), "exclude_modules", source),
            layers_to_transform=_layers(data.get("layers_to_transform"), source),
            layers_pattern=_list(data.get("layers_pattern"), "layers_pattern", source),
            ensure_weight_tying=_flag(data, "ensure_weight_tying", source),
        )

    def rank(self, module: str) -> int:
        """r of `module` (``rank_pattern`` first, as peft resolves it)."""
        key = _pattern_key([k for k, _ in self.rank_pattern], module)
        return dict(self.rank_pattern)[key] if key is not None else self.r

    def alpha(self, module: str) -> float:
        key = _pattern_key([k for k, _ in self.alpha_pattern], module)
        return dict(self.alpha_pattern)[key] if key is not None else self.lora_alpha

    def scale(self, module: str) -> float:
        """The factor of ``B @ A`` for `module`: alpha / r, or alpha / sqrt(r) with rsLoRA
        (the same Python float peft's layer computes)."""
        r, alpha = self.rank(module), self.alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str) -> bool:
        """Whether peft would put a LoRA on `module` (``target_modules`` as a list of names or
        name suffixes, or a regular expression matched against the whole name; ``all-linear``
        accepts any module: the caller checks it is a linear layer), minus
        ``exclude_modules``, within ``layers_to_transform``."""
        if _matches(self.exclude_modules, module):
            return False
        hit = self.target_modules == ALL_LINEAR or _matches(self.target_modules, module)
        if not hit or self.layers_to_transform is None:
            return hit
        patterns = self.layers_pattern or LAYERS_PATTERNS
        for pattern in patterns:
            m = re.match(rf".*\.{re.escape(pattern)}\.(\d+)\.", module)
            if m is not None:
                return int(m.group(1)) in self.layers_to_transform
        return False

    def targets_parameter(self, name: str) -> bool:
        """Whether peft wraps the parameter `name` (``target_parameters``: the full name or
        its last segments, as peft's `_inject_parameters` matches them)."""
        return any(_match_module(name, entry) for entry in self.target_parameters)

    def saves(self, module: str) -> bool:
        """Whether `module` is in ``modules_to_save`` (peft matches name suffixes)."""
        return any(_match_module(module, m) for m in self.modules_to_save)


def _matches(spec: tuple[str, ...] | str | None, module: str) -> bool:
    if spec is None:
        return False
    if isinstance(spec, str):
        try:
            return re.fullmatch(spec, module) is not None
        except re.error:
            return False
    return any(_match_module(module, entry) for entry in spec)


def _number(data: Mapping[str, Any], key: str, source: str, kind: type) -> float:
    value: Any = data.get(key)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if ok and kind is int and not float(value).is_integer():
        ok = False
    if not ok:
        raise CheckpointError(f"{source}: {key} {shown(value, 60)} is not a positive number")
    return float(value)


def _flag(data: Mapping[str, Any], key: str, source: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {key} {shown(value, 60)} is not true or false")
    return value


def _list(value: Any, key: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{source}: {key} {shown(value, 60)} is not a list of names")
    return tuple(value)


def _names(value: Any, key: str, source: str) -> tuple[str, ...] | str | None:
    if value is None or isinstance(value, str):
        return value
    return _list(value, key, source)


def _pattern(value: Any, key: str, source: str, kind: type) -> tuple[tuple[str, Any], ...]:
    if value in (None, {}):
        return ()
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: {key} {shown(value, 60)} is not an object")
    out = []
    for pattern, number in value.items():
        _number({key: number}, key, source, kind)
        out.append((str(pattern), kind(number)))
    return tuple(out)


def _layers(value: Any, source: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in items
    ):
        raise CheckpointError(
            f"{source}: layers_to_transform {shown(value, 60)} is not a layer index or a list"
        )
    return tuple(items)


__all__ = ["LoraSettings"]
