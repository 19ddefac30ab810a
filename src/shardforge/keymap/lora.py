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

The settings read from ``adapter_config.json`` are `keymap.lora_settings.LoraSettings`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

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


def _model_factor(name: str, parts: list[str], hits: list[int], source: str) -> str:
    """The adapter a PEFT-wrapped model's LoRA factor belongs to (``<module>.lora_A.<adapter>
    .weight`` or ``<module>.lora_embedding_A.<adapter>``), its spelling checked."""
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
    return leaf[0]


def _model_name(
    name: str, out: _Collect, adapters: set[str], pending: list[tuple[str, list[str], int]]
) -> None:
    """One name of a PEFT-wrapped model's state dict: a factor or modules_to_save copy waits in
    `pending` (its adapter is chosen once all names are seen), the rest go to `out`."""
    source = out.source
    path = _strip(name, False, source)
    parts = path.split(".")
    _unsupported(name, parts, source)
    hits = [i for i, p in enumerate(parts) if p in FACTORS]
    if hits:
        adapters.add(_model_factor(name, parts, hits, source))
        pending.append((name, parts, hits[-1]))
    elif MODULES_TO_SAVE in parts:
        i = parts.index(MODULES_TO_SAVE)
        rest = parts[i + 1 :]
        if i == 0 or len(rest) != 2:
            raise _unknown(name, source, f"a misplaced {MODULES_TO_SAVE!r} segment")
        adapters.add(rest[0])
        pending.append((name, parts, -1))
    elif ORIGINAL_MODULE in parts:
        i = parts.index(ORIGINAL_MODULE)
        if i == 0 or len(parts) != i + 2:
            raise _unknown(name, source, f"a misplaced {ORIGINAL_MODULE!r} segment")
        out.add(out.originals, ".".join(parts[:i] + parts[i + 1 :]), name, "original")
    else:
        if BASE_LAYER in parts:
            i = parts.index(BASE_LAYER)
            if i == 0 or parts.count(BASE_LAYER) > 1 or len(parts) != i + 2:
                raise _unknown(name, source, f"a misplaced {BASE_LAYER!r} segment")
            path = ".".join(parts[:i] + parts[i + 1 :])
        out.add(out.base, path, name, "base tensor")


def split_model_names(
    names: Iterable[str], adapter_name: str | None = None, source: str = "the checkpoint"
) -> LoraNames:
    """Split the tensor names of a PEFT-wrapped model's state dict (an FSDP/DCP checkpoint of
    LoRA training): every name is a LoRA factor, a base tensor or a modules_to_save copy.

    `adapter_name`: the adapter to take (default: the only one present; several are refused).
    """
    out = _Collect(source)
    adapters: set[str] = set()
    pending: list[tuple[str, list[str], int]] = []  # (name, segments, factor index or -1)
    for name in names:
        _model_name(name, out, adapters, pending)
    chosen = _one_adapter(adapters, adapter_name, source)
    for name, parts, i in pending:
        if i < 0:  # a modules_to_save copy
            j = parts.index(MODULES_TO_SAVE)
            if parts[j + 1] == chosen:
                hf = ".".join(parts[:j] + parts[j + 2 :])
                out.add(out.replacements, hf, name, "modules_to_save copy")
        elif parts[i + 1] == chosen:
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


__all__ = [
    "PEFT_PREFIX",
    "LoraNames",
    "LoraPair",
    "split_adapter_names",
    "split_model_names",
]


# a LoRA factor segment in a tensor name: what makes a checkpoint a LoRA checkpoint
_FACTOR = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B)(\.|$)")


def has_lora(names: list[str]) -> bool:
    """The checkpoint holds LoRA factors (it is LoRA training's, not a full model's)."""
    return any(_FACTOR.search(n) for n in names)
