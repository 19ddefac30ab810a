"""LoRA names and settings: constant tables and pure functions, whatever holds the tensors.

Two spellings of a LoRA model's tensors are understood:

* the adapter file peft's ``save_pretrained`` writes (`split_adapter_names`):
  ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (linear layers),
  ``base_model.model.<module>.lora_embedding_A`` / ``_B`` (embeddings),
  ``base_model.model.<module>.base_layer.weight`` (an embedding's base weight, saved with
  ``save_embedding_layers``), and ``base_model.model.<module>.weight`` for a module of
  ``modules_to_save`` (its trained copy, replacing the base module's tensor);
* the state dict of a PEFT-wrapped model, as an FSDP/DCP checkpoint stores it
  (`split_model_names`): ``<module>.base_layer.weight``, ``<module>.lora_A.<adapter>.weight``,
  ``<module>.lora_embedding_A.<adapter>``, ``<module>.modules_to_save.<adapter>.weight``,
  ``<module>.original_module.weight`` and every other tensor under its own name, each with or
  without the ``base_model.model.`` prefix (wrapper segments such as ``_orig_mod.`` are the
  caller's to remove first: `shardforge.keymap.keys.clean_name`).

Both give a `LoraNames`: the LoRA pairs by module (Hugging Face module path), the base tensors
by Hugging Face name, and the modules_to_save replacements by Hugging Face name. A name neither
spelling explains is a `CheckpointError`, as is one of an adapter kind shardforge does not fuse
(DoRA's magnitude vector, LoRA biases, trainable tokens, AdaLoRA, ...).

`LoraSettings` is what the fuse needs from ``adapter_config.json``: the per-module scale
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` and
``alpha_pattern`` per module, matched as peft matches them), which modules are targeted, which
are saved whole, and ``fan_in_fan_out``. Settings that change the arithmetic in ways the fuse
does not implement are refused with the feature's name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardforge.errors import CheckpointError, printable, shown

# the prefix peft puts in front of the wrapped model's names
PEFT_PREFIX = "base_model.model."
# the adapter name a single-adapter PeftModel uses
DEFAULT_ADAPTER = "default"
# segments of a PEFT-wrapped model's names
BASE_LAYER = "base_layer"
MODULES_TO_SAVE = "modules_to_save"
ORIGINAL_MODULE = "original_module"
# LoRA factor segment -> (which factor, embedding layer); A is (r, in), B is (out, r), and an
# embedding's delta is (B @ A).T
FACTORS: dict[str, tuple[str, bool]] = {
    "lora_A": ("A", False),
    "lora_B": ("B", False),
    "lora_embedding_A": ("A", True),
    "lora_embedding_B": ("B", True),
}
# segments of adapter kinds shardforge does not fuse -> the feature (one clear refusal)
UNSUPPORTED_SEGMENTS: dict[str, str] = {
    "lora_magnitude_vector": "DoRA (use_dora)",
    "trainable_tokens_delta": "trainable tokens (trainable_token_indices)",
    "token_adapter": "trainable tokens (trainable_token_indices)",
    "lora_E": "AdaLoRA",
    "ranknum": "AdaLoRA",
    "hada_w1": "LoHa",
    "lokr_w1": "LoKr",
    "ia3_l": "IA3",
    "lora_variant": "a LoRA variant",
}

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
    "target_parameters": ("LoRA on parameters (target_parameters)", (None, [])),
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


# ------------------------------------------------------------------------------------ names


@dataclass(frozen=True)
class LoraPair:
    """The two factor tensors of one adapted module (input names) and its kind."""

    a: str
    b: str
    embedding: bool = False  # the delta is (B @ A).T

    @property
    def weight(self) -> str:
        """The suffix of the adapted tensor: the module's ``weight``."""
        return "weight"


@dataclass(frozen=True)
class LoraNames:
    """A set of names split by what they are (input name kept as the value).

    `pairs`: module path (``model.layers.0.self_attn.q_proj``) -> its LoRA factors;
    `base`: Hugging Face tensor name -> input name of the base model's tensor (``base_layer``
    and the prefix stripped; in an adapter file only the embedding copies of
    ``save_embedding_layers``); `replacements`: Hugging Face tensor name -> input name of a
    modules_to_save copy; `originals`: Hugging Face tensor name -> input name of the untrained
    original a modules_to_save wrapper keeps (never written).
    """

    pairs: dict[str, LoraPair]
    base: dict[str, str]
    replacements: dict[str, str]
    originals: dict[str, str]

    def fused_names(self) -> dict[str, str]:
        """Hugging Face tensor name of each adapted weight -> its module."""
        return {f"{module}.{pair.weight}": module for module, pair in self.pairs.items()}


def _unsupported(name: str, parts: list[str], source: str) -> None:
    for part in parts:
        feature = UNSUPPORTED_SEGMENTS.get(part)
        if feature is not None:
            raise CheckpointError(
                f"{source}: {printable(name)} belongs to {feature}, which shardforge does not "
                "fuse; merge this adapter with peft's merge_and_unload instead"
            )


def _unknown(name: str, source: str, why: str) -> CheckpointError:
    return CheckpointError(f"{source}: {shown(name)} is not a LoRA adapter tensor name ({why})")


class _Collect:
    """The pairs being assembled, with the duplicate and half-pair checks."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.factors: dict[str, dict[str, tuple[str, bool]]] = {}
        self.base: dict[str, str] = {}
        self.replacements: dict[str, str] = {}
        self.originals: dict[str, str] = {}

    def factor(self, module: str, which: str, embedding: bool, name: str) -> None:
        slot = self.factors.setdefault(module, {})
        if which in slot:
            raise CheckpointError(
                f"{self.source}: {printable(module)} has two LoRA {which} tensors "
                f"({printable(slot[which][0])}, {printable(name)})"
            )
        slot[which] = (name, embedding)

    def add(self, table: dict[str, str], hf: str, name: str, what: str) -> None:
        if hf in table:
            raise CheckpointError(
                f"{self.source}: {printable(table[hf])} and {printable(name)} are both the "
                f"{what} of {printable(hf)}"
            )
        table[hf] = name

    def done(self) -> LoraNames:
        pairs: dict[str, LoraPair] = {}
        for module, slot in sorted(self.factors.items()):
            if set(slot) != {"A", "B"}:
                lacking = "B" if "A" in slot else "A"
                raise CheckpointError(
                    f"{self.source}: {printable(module)} has a LoRA "
                    f"{'A' if lacking == 'B' else 'B'} tensor but no {lacking}; the adapter is "
                    "incomplete"
                )
            (a, emb_a), (b, emb_b) = slot["A"], slot["B"]
            if emb_a != emb_b:
                raise CheckpointError(
                    f"{self.source}: {printable(module)} mixes linear and embedding LoRA "
                    f"tensors ({printable(a)}, {printable(b)})"
                )
            pairs[module] = LoraPair(a, b, emb_a)
        for module in pairs:
            weight = f"{module}.weight"
            if weight in self.replacements:
                raise CheckpointError(
                    f"{self.source}: {printable(module)} has both LoRA factors and a "
                    "modules_to_save copy; shardforge does not fuse a LoRA inside a saved module"
                )
        return LoraNames(pairs, self.base, self.replacements, self.originals)


def _strip(name: str, prefix_required: bool, source: str) -> str:
    if name.startswith(PEFT_PREFIX):
        return name[len(PEFT_PREFIX) :]
    if prefix_required:
        raise _unknown(name, source, f"an adapter file's names start with {PEFT_PREFIX!r}")
    return name


def split_adapter_names(names: Iterable[str], source: str = "the adapter") -> LoraNames:
    """Split the tensor names of a peft adapter file (``adapter_model.safetensors``)."""
    out = _Collect(source)
    for name in names:
        path = _strip(name, True, source)
        parts = path.split(".")
        _unsupported(name, parts, source)
        hits = [i for i, p in enumerate(parts) if p in FACTORS]
        if hits:
            i = hits[-1]
            which, embedding = FACTORS[parts[i]]
            # a linear layer's factor is a module (`lora_A.weight`), an embedding's a
            # parameter (`lora_embedding_A`)
            leaf = parts[i + 1 :]
            if len(hits) > 1 or i == 0 or leaf != ([] if embedding else ["weight"]):
                if not embedding and leaf == ["bias"]:
                    raise CheckpointError(
                        f"{source}: {printable(name)} is a LoRA bias (lora_bias), which "
                        "shardforge does not fuse"
                    )
                raise _unknown(name, source, "unexpected segments around the LoRA factor")
            out.factor(".".join(parts[:i]), which, embedding, name)
            continue
        if BASE_LAYER in parts:
            i = parts.index(BASE_LAYER)
            if i == 0 or parts.count(BASE_LAYER) > 1 or len(parts) != i + 2:
                raise _unknown(name, source, f"a misplaced {BASE_LAYER!r} segment")
            out.add(out.base, ".".join(parts[:i] + parts[i + 1 :]), name, "base tensor")
            continue
        if MODULES_TO_SAVE in parts or ORIGINAL_MODULE in parts:
            # older peft spellings: <module>.modules_to_save[.<adapter>].<leaf>
            hf = _saved_module_name(parts, source, name)
            if hf is not None:
                out.add(out.replacements, hf, name, "modules_to_save copy")
            continue
        if len(parts) < 2:
            raise _unknown(name, source, "no module path")
        out.add(out.replacements, path, name, "modules_to_save copy")
    return out.done()


def _saved_module_name(parts: list[str], source: str, name: str) -> str | None:
    """HF name of `<module>.modules_to_save[.<adapter>].<leaf>`; None for an
    `original_module` copy (the untrained original, dropped)."""
    if ORIGINAL_MODULE in parts:
        i = parts.index(ORIGINAL_MODULE)
        if i == 0 or len(parts) != i + 2:
            raise _unknown(name, source, f"a misplaced {ORIGINAL_MODULE!r} segment")
        return None
    i = parts.index(MODULES_TO_SAVE)
    rest = parts[i + 1 :]
    if i == 0 or len(rest) not in (1, 2):
        raise _unknown(name, source, f"a misplaced {MODULES_TO_SAVE!r} segment")
    return ".".join(parts[:i] + rest[-1:])


def split_model_names(
    names: Iterable[str], adapter_name: str | None = None, source: str = "the checkpoint"
) -> LoraNames:
    """Split the tensor names of a PEFT-wrapped model's state dict (an FSDP/DCP checkpoint of
    LoRA training): every name is a LoRA factor, a base tensor or a modules_to_save copy.

    `adapter_name`: the adapter to take (default: the only one present; several are refused).
    """
    out = _Collect(source)
    adapters: set[str] = set()
    factors: list[tuple[str, list[str], int]] = []
    for name in names:
        path = _strip(name, False, source)
        parts = path.split(".")
        _unsupported(name, parts, source)
        hits = [i for i, p in enumerate(parts) if p in FACTORS]
        if hits:
            i = hits[-1]
            embedding = FACTORS[parts[i]][1]
            want = 1 if embedding else 2  # <adapter> or <adapter>.weight
            leaf = parts[i + 1 :]
            bad = len(leaf) != want or (not embedding and leaf[1] != "weight")
            if len(hits) > 1 or i == 0 or bad:
                if not embedding and len(leaf) == 2 and leaf[1] == "bias":
                    raise CheckpointError(
                        f"{source}: {printable(name)} is a LoRA bias (lora_bias), which "
                        "shardforge does not fuse"
                    )
                raise _unknown(name, source, "unexpected segments around the LoRA factor")
            adapters.add(leaf[0])
            factors.append((name, parts, i))
            continue
        if MODULES_TO_SAVE in parts:
            i = parts.index(MODULES_TO_SAVE)
            rest = parts[i + 1 :]
            if i == 0 or len(rest) != 2:
                raise _unknown(name, source, f"a misplaced {MODULES_TO_SAVE!r} segment")
            adapters.add(rest[0])
            factors.append((name, parts, -1))
            continue
        if ORIGINAL_MODULE in parts:
            i = parts.index(ORIGINAL_MODULE)
            if i == 0 or len(parts) != i + 2:
                raise _unknown(name, source, f"a misplaced {ORIGINAL_MODULE!r} segment")
            out.add(out.originals, ".".join(parts[:i] + parts[i + 1 :]), name, "original")
            continue
        if BASE_LAYER in parts:
            i = parts.index(BASE_LAYER)
            if i == 0 or parts.count(BASE_LAYER) > 1 or len(parts) != i + 2:
                raise _unknown(name, source, f"a misplaced {BASE_LAYER!r} segment")
            path = ".".join(parts[:i] + parts[i + 1 :])
        out.add(out.base, path, name, "base tensor")
    chosen = _one_adapter(adapters, adapter_name, source)
    for name, parts, i in factors:
        if i < 0:  # a modules_to_save copy
            j = parts.index(MODULES_TO_SAVE)
            if parts[j + 1] == chosen:
                hf = ".".join(parts[:j] + parts[j + 2 :])
                out.add(out.replacements, hf, name, "modules_to_save copy")
            continue
        if parts[i + 1] != chosen:
            continue
        which, embedding = FACTORS[parts[i]]
        out.factor(".".join(parts[:i]), which, embedding, name)
    names_ = out.done()
    for hf in names_.replacements:
        if hf not in names_.originals and hf in names_.base:
            raise CheckpointError(
                f"{source}: {printable(hf)} is both a base tensor and a modules_to_save copy"
            )
    return names_


def _one_adapter(found: set[str], wanted: str | None, source: str) -> str | None:
    if wanted is not None:
        if found and wanted not in found:
            raise CheckpointError(
                f"{source}: no adapter named {shown(wanted)} (found {', '.join(sorted(found))})"
            )
        return wanted
    if len(found) > 1:
        raise CheckpointError(
            f"{source}: holds {len(found)} adapters ({printable(', '.join(sorted(found)))}); "
            "name the one to fuse"
        )
    return next(iter(found), None)


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


__all__ = [
    "PEFT_PREFIX",
    "LoraNames",
    "LoraPair",
    "LoraSettings",
    "split_adapter_names",
    "split_model_names",
]


# a LoRA factor segment in a tensor name: what makes a checkpoint a LoRA checkpoint
_FACTOR = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B)(\.|$)")


def has_lora(names: list[str]) -> bool:
    """The checkpoint holds LoRA factors (it is LoRA training's, not a full model's)."""
    return any(_FACTOR.search(n) for n in names)
