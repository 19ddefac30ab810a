"""Map a checkpoint's key names to Hugging Face's: a table of name adapters (torchtitan), chosen
by the layout or detected from the names.

    named = adapt_names(candidate.adapter, candidate.model_dir, named, hf_config)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardforge.formats.registry import NamedSource
from shardforge.formats.sources import TransformedSource
from shardforge.keymap.keys import TORCHTITAN, looks_like_torchtitan

log = logging.getLogger("shardforge")


def key_adapter(hint: str | None, named: dict[str, NamedSource]) -> str | None:
    """The adapter to apply: the layout's `hint`, else torchtitan when the names say so."""
    if hint is not None:
        return hint
    keys = [".".join(n.path) for n in named.values()]
    return TORCHTITAN if looks_like_torchtitan(keys) else None


def _titan_transform(adapter: Any, hf_name: str, config: Any, tensor: torch.Tensor) -> torch.Tensor:
    return adapter.transform(hf_name, tensor, config)


def _from_torchtitan(
    model_dir: Path, named: dict[str, NamedSource], config: Any
) -> dict[str, NamedSource]:
    from shardforge.keymap.titan import get_adapter, is_model_key

    model_type = str(getattr(config, "model_type", ""))
    adapter = get_adapter(model_type)
    names = {".".join(n.path): n for n in named.values()}
    weights = {k: n for k, n in names.items() if is_model_key(k)}
    adapter.check_names(list(weights), str(model_dir))
    out: dict[str, NamedSource] = {}
    for titan_name, n in weights.items():
        # a tied output keeps its HF name: the merge compares it with the embedding and stores
        # it once (the one tied rule: `keys.check_tied_copies`, `keys.stored_once`)
        hf_name = adapter.convert_name(titan_name)
        if hf_name is None:
            continue
        source = n.source
        if adapter.needs_transform(hf_name):
            source = TransformedSource(
                source, functools.partial(_titan_transform, adapter, hf_name, config)
            )
        out[hf_name] = NamedSource((hf_name,), source)
    log.info(
        "torchtitan names mapped to Hugging Face names (model_type %s): %d tensors",
        model_type,
        len(out),
    )
    return out


# key-name adapter -> function mapping a checkpoint's names (and tensors) to Hugging Face's
NAME_ADAPTERS: dict[str, Callable[[Path, dict[str, NamedSource], Any], dict[str, NamedSource]]] = {
    TORCHTITAN: _from_torchtitan,
}


def adapt_names(
    hint: str | None, model_dir: Path, named: dict[str, NamedSource], config: Any
) -> dict[str, NamedSource]:
    """`named` under Hugging Face names: unchanged, or through the layout's (`hint`) or the
    detected name adapter."""
    adapter = key_adapter(hint, named)
    return named if adapter is None else NAME_ADAPTERS[adapter](model_dir, named, config)
