"""The expected tensors of the model, from its config on the meta device (no weights loaded).

The architecture is built as ``from_pretrained`` would build it: a quantized config's modules
are replaced by transformers' own quantizer (FP8: ``float8_e4m3fn`` weights beside their
``weight_scale_inv``), MXFP4-packed experts take their stored names and shapes
(`keymap.quantized`), and the names ``save_pretrained`` writes are taken from transformers' own
weight conversion (`keymap.conversion`: fused MoE experts saved per expert). A checkpoint may
name its tensors either way (in-memory names, as transformers 5 training saves them, or the
saved names, as older versions did); the output always has the saved names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from shardforge.config.peft import linear_layer_names
from shardforge.errors import MergeError, printable
from shardforge.formats.base import TensorSource
from shardforge.io.files import check_size
from shardforge.keymap.conversion import SavedLayout, saved_layout
from shardforge.keymap.converted import saved_sources
from shardforge.keymap.keys import stored_once, tied_pairs
from shardforge.keymap.quantized import META_QUANTIZED, MXFP4, mxfp4_packed, quant_method
from shardforge.sinks.cast import KeepPattern, model_keep_patterns
from shardforge.startup import import_model_code

log = logging.getLogger("shardforge")

FSDP_ARCH_PREFIX = "FSDP"


@dataclass(frozen=True)
class ExpectedModel:
    """Names, shapes and dtypes the model's state dict has, in its order, and its tied pairs;
    `saved`: how it is saved when that is under other names (None: as it is in memory)."""

    config: Any
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    tied: dict[str, str]  # target (dropped on save) -> source (kept)
    total_parameters: int
    saved: SavedLayout | None = None
    # the last name segment of every linear layer but the output one (lora_target_linear)
    linear_names: tuple[str, ...] = ()
    keep: tuple[KeepPattern, ...] = ()  # what the model class keeps in float32 (sinks.cast)
    # modules whose stacked expert weights are (experts, in, out) (`is_transposed`); the
    # others' are (experts, out, in)
    transposed: frozenset[str] = frozenset()

    @property
    def renamed_on_save(self) -> bool:
        """Whether save_pretrained writes other names than the in-memory ones."""
        return self.saved is not None

    @property
    def saved_names(self) -> list[str]:
        """Names written to disk, in save order: tied targets are stored once, under their
        source; converted tensors under their saved names."""
        if self.saved is not None:
            return list(self.saved.shapes)
        return stored_once(self.shapes, self.tied)

    @property
    def accepted(self) -> dict[str, tuple[int, ...]]:
        """Every name a checkpoint may hold, with its shape: in-memory and saved names."""
        return {**self.shapes, **(self.saved.shapes if self.saved is not None else {})}

    def as_saved(self) -> ExpectedModel:
        """The model as ``save_pretrained`` writes it (saved names, shapes and dtypes; tied
        targets kept), for a fusion of base files that hold it so (`merge.lora`)."""
        if self.saved is None:
            return self
        tied = {t: self.shapes[t] for t in self.tied}
        return replace(
            self,
            shapes={**self.saved.shapes, **tied},
            dtypes={**self.saved.dtypes, **{t: self.dtypes[t] for t in tied}},
            saved=None,
        )

    def dtype_of(self, name: str) -> torch.dtype:
        if name in self.dtypes:
            return self.dtypes[name]
        assert self.saved is not None
        return self.saved.dtypes[name]

    def to_saved(self, by_name: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
        """The sources under their saved names, from sources under in-memory or saved names
        (tied targets and names saved as they are pass unchanged)."""
        if self.saved is None:
            return dict(by_name)
        made = saved_sources(self.saved, by_name)
        direct = {n: s for n, s in by_name.items() if n in self.saved.shapes}
        twice = sorted(n for n in set(made) & set(direct) if made[n] is not direct[n])
        if twice:
            raise MergeError(
                f"the checkpoint stores {twice[0]!r} twice: under its saved name and as part "
                "of an in-memory tensor"
            )
        kept = {n: s for n, s in by_name.items() if n in self.tied}
        out = {**made, **direct}
        return {**{n: out[n] for n in self.saved.shapes if n in out}, **kept}


def clean_architectures(config: Any) -> None:
    """Remove an `FSDP` prefix (left by some wrappers) from `config.architectures`."""
    archs = getattr(config, "architectures", None)
    if archs:
        config.architectures = [
            a[len(FSDP_ARCH_PREFIX) :] if a.startswith(FSDP_ARCH_PREFIX) else a for a in archs
        ]


def load_config(source: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    local = Path(source)  # a local folder's (or file's) config, before transformers reads it
    check_size(local if local.is_file() else local / "config.json")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise MergeError(
            f"cannot read the model config from {source!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); set base_model or base_model_config"
        ) from None
    clean_architectures(config)
    return config


def build_expected(config: Any, trust_remote_code: bool) -> ExpectedModel:
    """Instantiate the architecture on the meta device and record what its state dict holds."""
    import_model_code()  # without the packages a meta-device build never uses
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise MergeError(
            f"cannot build the model from its config ({type(exc).__name__}: {exc})"
        ) from None
    _quantize(model, config)
    sd = _packed(model.state_dict(), config)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    dtypes = {k: v.dtype for k, v in sd.items()}
    tied = tied_pairs(model, config)
    total = sum(p.numel() for p in model.parameters())
    kept = {k: v for k, v in sd.items() if k not in tied}
    return ExpectedModel(
        config,
        shapes,
        dtypes,
        tied,
        total,
        _saved_layout(model, kept),
        tuple(linear_layer_names(model)),
        model_keep_patterns(model),
        frozenset(n for n, m in model.named_modules() if getattr(m, "is_transposed", None) is True),
    )


def _quantize(model: Any, config: Any) -> None:
    """Replace the modules of a quantized config as ``from_pretrained`` does (transformers'
    quantizer, kept quantized), on the meta device; MXFP4 is described by `_packed`."""
    method = quant_method(config)
    if method not in META_QUANTIZED:
        return
    from transformers.quantizers import AutoHfQuantizer

    try:
        quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
        if hasattr(quantizer.quantization_config, "dequantize"):
            quantizer.quantization_config.dequantize = False
        with torch.device("meta"):
            quantizer.preprocess_model(model, config=config, device_map=None)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise MergeError(
            f"cannot build the {method!r}-quantized architecture on the meta device "
            f"({type(exc).__name__}: {reason})"
        ) from None


def _packed(state_dict: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`state_dict` with MXFP4-packed experts under their stored names, shapes and dtype."""
    if quant_method(config) != MXFP4:
        return state_dict
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        packed = mxfp4_packed(name, tuple(t.shape), config)
        for k, shape in packed.items():
            out[k] = torch.empty(shape, dtype=torch.uint8, device="meta")
        if not packed:
            out[name] = t
    return out


def _saved_layout(model: Any, state_dict: dict[str, torch.Tensor]) -> SavedLayout | None:
    """How save_pretrained names and cuts `state_dict` (None: as it is)."""
    try:
        return saved_layout(model, state_dict)
    except MergeError:
        raise
    except Exception as exc:  # transformers' own failure: say what it was, advise nothing
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise MergeError(
            f"cannot tell under which names {type(model).__name__} is saved: transformers' "
            f"weight conversion failed ({type(exc).__name__}: {reason})"
        ) from None


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "int"


def check_against(
    expected: ExpectedModel,
    entries: Mapping[str, Any],
    to_hf: Mapping[str, str],
    unexpected: list[str],
    source: str,
) -> None:
    """Raise one MergeError listing every missing, unexpected, mis-shaped or mis-typed tensor
    (`entries`: checkpoint key -> anything with `shape` and `dtype`; `to_hf`: checkpoint key ->
    in-memory or saved name)."""
    present = set(to_hf.values())
    missing = _missing(expected, present)
    accepted = expected.accepted
    bad_shape, bad_dtype = [], []
    for key, name in to_hf.items():
        e = entries[key]
        if e.shape != accepted[name]:
            bad_shape.append(f"{name} {list(e.shape)} vs {list(accepted[name])}")
        elif _kind(e.dtype) != _kind(expected.dtype_of(name)):
            bad_dtype.append(f"{name} {e.dtype} vs {expected.dtype_of(name)}")
    # (what, count word, items): the headline counts each kind, the details list every item
    kinds = [
        ("missing", "missing", missing),
        ("unexpected", "unexpected", [printable(k) for k in unexpected]),
        ("shape mismatch (checkpoint vs config)", "shape mismatches", bad_shape),
        ("dtype mismatch (checkpoint vs config)", "dtype mismatches", bad_dtype),
    ]
    found = [(what, word, items) for what, word, items in kinds if items]
    if found:
        counts = ", ".join(f"{len(items)} {word}" for _, word, items in found)
        raise MergeError(
            f"the checkpoint does not match the architecture from {source} ({counts}); "
            "check base_model / base_model_config",
            [f"{what}: {item}" for what, _, items in found for item in items],
        )


def _missing(expected: ExpectedModel, present: set[str]) -> list[str]:
    """The tensors the checkpoint lacks: in-memory names when it names its tensors that way
    (or holds none of the saved-only names), else saved names."""
    in_memory = [n for n in stored_once(expected.shapes, expected.tied) if n not in present]
    saved = expected.saved
    if saved is None:
        return in_memory
    saved_only = set(saved.shapes) - set(expected.shapes)
    if not present & saved_only:
        return in_memory
    groups = saved.group_of()
    covered = set(present)
    for name, memory in saved.renamed.items():
        if memory in present:
            covered.add(name)
    for group in {id(g): g for g in groups.values()}.values():
        if all(s in present for s in group.sources):
            covered.update(group.outputs)
    return [n for n in saved.shapes if n not in covered]
