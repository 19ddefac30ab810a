"""Open a found checkpoint as named tensor sources, whatever its kind and key names.

    named = open_checkpoint(candidate)                  # key -> NamedSource (metadata only)
    named = adapt_names(candidate, named, hf_config)    # torchtitan names -> HF names

A table maps each candidate kind to its reader; adding a kind is adding a row.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.checkpoint.keys import clean_name
from shardforge.checkpoint.layouts import DCP, RANK_FILES, TORCHTITAN, Candidate, check_model_keys
from shardforge.checkpoint.sources import (
    DcpSource,
    RankFileSource,
    TensorSource,
    TransformedSource,
)
from shardforge.errors import CheckpointError

log = logging.getLogger("shardforge")

# first keys that only a torchtitan checkpoint has (HF names are `model.embed_tokens...`)
TITAN_MARKERS: tuple[str, ...] = ("tok_embeddings.weight", "layers.0.attention")
# verl writes this beside its rank files: {"FSDP_version": 2, "world_size": W}
FSDP_CONFIG = "fsdp_config.json"


@dataclass(frozen=True)
class NamedSource:
    """One tensor of a checkpoint: its original path (for key mapping) and its source."""

    path: tuple[str, ...]
    source: TensorSource

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype


def _open_dcp(candidate: Candidate) -> dict[str, NamedSource]:
    from shardforge.checkpoint.metadata import read_metadata

    meta = read_metadata(candidate.model_dir)
    check_model_keys(candidate.model_dir, list(meta.tensors))
    return {k: NamedSource(e.path, DcpSource(e, meta.directory)) for k, e in meta.tensors.items()}


def check_fsdp_config(model_dir: Path, world_size: int) -> None:
    """verl's `fsdp_config.json` beside the rank files must name their world size."""
    path = model_dir / FSDP_CONFIG
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8")).get("world_size")
    except (ValueError, AttributeError, OSError):
        log.warning("%s: not readable JSON; ignored", path)
        return
    if isinstance(recorded, int) and recorded != world_size:
        raise CheckpointError(
            f"{path}: says world_size {recorded}, but {model_dir} holds the rank files of "
            f"world size {world_size}; the folder mixes runs or is incomplete"
        )


def _open_rank_files(candidate: Candidate) -> dict[str, NamedSource]:
    from shardforge.rankfiles.rank_file import read_rank_file
    from shardforge.rankfiles.rank_plan import list_rank_files, plan_from_files

    paths = list_rank_files(candidate.model_dir)
    check_fsdp_config(candidate.model_dir, len(paths))
    plans = plan_from_files([read_rank_file(p) for p in paths.values()])
    return {k: NamedSource((k,), RankFileSource(p)) for k, p in plans.items()}


READERS: dict[str, Callable[[Candidate], dict[str, NamedSource]]] = {
    DCP: _open_dcp,
    RANK_FILES: _open_rank_files,
}


def open_checkpoint(candidate: Candidate) -> dict[str, NamedSource]:
    """Every tensor of the candidate's model directory (nothing but metadata is read)."""
    reader = READERS.get(candidate.kind)
    if reader is None:
        raise CheckpointError(f"{candidate.model_dir}: unknown checkpoint kind {candidate.kind!r}")
    return reader(candidate)


def looks_like_torchtitan(keys: list[str]) -> bool:
    """True when the keys use torchtitan's names (`tok_embeddings.weight`, `layers.0.attention`)."""
    names = [clean_name(k).removeprefix("model.") for k in keys]
    return any(n.startswith(TITAN_MARKERS) for n in names)


def key_adapter(candidate: Candidate, named: dict[str, NamedSource]) -> str | None:
    """The adapter to apply: the layout's, else torchtitan when the names say so."""
    if candidate.adapter is not None:
        return candidate.adapter
    keys = [".".join(n.path) for n in named.values()]
    return TORCHTITAN if looks_like_torchtitan(keys) else None


def _titan_transform(adapter: Any, hf_name: str, config: Any, tensor: torch.Tensor) -> torch.Tensor:
    return adapter.transform(hf_name, tensor, config)


def _from_torchtitan(
    candidate: Candidate, named: dict[str, NamedSource], config: Any
) -> dict[str, NamedSource]:
    from shardforge.adapters import get_adapter, is_model_key

    model_type = str(getattr(config, "model_type", ""))
    adapter = get_adapter(model_type)
    names = {".".join(n.path): n for n in named.values()}
    weights = {k: n for k, n in names.items() if is_model_key(k)}
    adapter.check_names(list(weights), str(candidate.model_dir))
    out: dict[str, NamedSource] = {}
    for titan_name, n in weights.items():
        hf_name = adapter.convert_name(titan_name, config)
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


ADAPTERS: dict[str, Callable[[Candidate, dict[str, NamedSource], Any], dict[str, NamedSource]]] = {
    TORCHTITAN: _from_torchtitan,
}


def adapt_names(
    candidate: Candidate, named: dict[str, NamedSource], config: Any
) -> dict[str, NamedSource]:
    """`named` under Hugging Face names: unchanged, or through the candidate's key adapter."""
    adapter = key_adapter(candidate, named)
    return named if adapter is None else ADAPTERS[adapter](candidate, named, config)
