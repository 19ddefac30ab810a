"""The expected tensors of the model, from its config on the meta device (no weights loaded)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.errors import MergeError, printable
from shardforge.keymap.keys import stored_once, tied_pairs
from shardforge.sinks.cast import KeepPattern, model_keep_patterns

log = logging.getLogger("shardforge")

FSDP_ARCH_PREFIX = "FSDP"


@dataclass(frozen=True)
class ExpectedModel:
    """Names, shapes and dtypes the model's state dict has, in its order, and its tied pairs."""

    config: Any
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    tied: dict[str, str]  # target (dropped on save) -> source (kept)
    total_parameters: int
    renamed_on_save: bool = False  # transformers 5.x weight conversion changes names on disk
    keep: tuple[KeepPattern, ...] = ()  # what the model class keeps in float32 (sinks.cast)

    @property
    def saved_names(self) -> list[str]:
        """Names written to disk: tied targets are stored once, under their source."""
        return stored_once(self.shapes, self.tied)


def clean_architectures(config: Any) -> None:
    """Remove an `FSDP` prefix (left by some wrappers) from `config.architectures`."""
    archs = getattr(config, "architectures", None)
    if archs:
        config.architectures = [
            a[len(FSDP_ARCH_PREFIX) :] if a.startswith(FSDP_ARCH_PREFIX) else a for a in archs
        ]


def load_config(source: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

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
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise MergeError(
            f"cannot build the model from its config ({type(exc).__name__}: {exc})"
        ) from None
    sd = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    dtypes = {k: v.dtype for k, v in sd.items()}
    tied = tied_pairs(model, config)
    total = sum(p.numel() for p in model.parameters())
    renamed = _renamed_on_save(model, sd)
    return ExpectedModel(config, shapes, dtypes, tied, total, renamed, model_keep_patterns(model))


def _renamed_on_save(model: Any, state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether save_pretrained would write other names than the in-memory ones."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: names on disk are the in-memory names
        return False
    try:
        reverted = revert_weight_conversion(model, dict(state_dict))
    except Exception as exc:  # transformers' own failure: say what it was, advise nothing
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise MergeError(
            f"cannot tell under which names {type(model).__name__} is saved: transformers' "
            f"revert_weight_conversion failed ({type(exc).__name__}: {reason})"
        ) from None
    return set(reverted) != set(state_dict)


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
    (`entries`: checkpoint key -> anything with `shape` and `dtype`)."""
    present = set(to_hf.values())
    missing = [n for n in expected.saved_names if n not in present]
    bad_shape, bad_dtype = [], []
    for key, name in to_hf.items():
        e = entries[key]
        if e.shape != expected.shapes[name]:
            bad_shape.append(f"{name} {list(e.shape)} vs {list(expected.shapes[name])}")
        elif _kind(e.dtype) != _kind(expected.dtypes[name]):
            bad_dtype.append(f"{name} {e.dtype} vs {expected.dtypes[name]}")
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
