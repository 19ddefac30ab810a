"""Map a torchtitan checkpoint's tensors to Hugging Face names and layouts, one tensor at a time.

    adapter = get_adapter(config["model_type"])        # ShardforgeError if unsupported
    for name, tensor in titan_tensors:                  # e.g. streamed from a DCP checkpoint
        hf_name = adapter.convert_name(name)    # None: not a weight
        if hf_name is None:
            continue
        if adapter.needs_transform(hf_name):
            tensor = adapter.transform(hf_name, tensor, config)
        ...

`config` is the HF config: a ``PretrainedConfig`` or the parsed ``config.json`` mapping.
The only transform is Llama's RoPE q/k row permutation, which needs that one whole tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.keymap.titan import tables
from shardforge.keymap.titan.rope_permute import interleaved_to_half

# very old torchtitan checkpoints store model keys under `model.`
LEGACY_PREFIX = "model."

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.)")


def _abstract(name: str) -> tuple[str, list[str]]:
    """'layers.3.attention.wq.weight' -> ('layers.{}.attention.wq.weight', ['3'])."""
    indices = _INDEX.findall(name)
    return _INDEX.sub("{}", name), indices


def is_model_key(name: str) -> bool:
    """False for a torchtitan checkpoint's training state (optimizer, lr_scheduler, dataloader,
    train_state), True for everything else (model weights, under `model.` in old checkpoints)."""
    return name.split(".", 1)[0] not in tables.TRAINING_STATES


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """Read `key` from an HF config object or a config.json mapping."""
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


@dataclass(frozen=True)
class StateDictAdapter:
    """Name table and tensor transforms for one model family (see `tables`)."""

    model_type: str
    names: Mapping[str, str]
    skipped: tuple[str, ...] = tables.SKIPPED_NAMES
    rope_permuted: Mapping[str, str] = field(default_factory=dict)

    def _strip(self, name: str) -> str:
        return name[len(LEGACY_PREFIX) :] if name.startswith(LEGACY_PREFIX) else name

    def is_skipped(self, name: str) -> bool:
        """True for non-weight entries (RoPE caches such as `freqs_cis`) that HF recomputes."""
        pattern, _ = _abstract(self._strip(name))
        return pattern in self.skipped

    def to_hf_name(self, name: str) -> str:
        """The HF name of torchtitan key `name`; CheckpointError if the key is unknown."""
        pattern, indices = _abstract(self._strip(name))
        hf_pattern = self.names.get(pattern)
        if hf_pattern is None or hf_pattern.count("{}") != len(indices):
            raise CheckpointError(
                f"torchtitan key {name!r} has no Hugging Face name for model_type "
                f"{self.model_type!r}; known keys: {', '.join(sorted(self.names))}"
            )
        return hf_pattern.format(*indices)

    def unknown_names(self, names: Iterable[str]) -> list[str]:
        """Every name that is neither skipped nor in the table (to report them all at once)."""
        out = []
        for name in names:
            if self.is_skipped(name):
                continue
            pattern, indices = _abstract(self._strip(name))
            hf_pattern = self.names.get(pattern)
            if hf_pattern is None or hf_pattern.count("{}") != len(indices):
                out.append(name)
        return out

    def check_names(self, names: Iterable[str], source: str = "checkpoint") -> None:
        """Raise one CheckpointError listing every key the table cannot map."""
        unknown = self.unknown_names(names)
        if unknown:
            raise CheckpointError(
                f"{source}: {len(unknown)} torchtitan key(s) have no Hugging Face name for "
                f"model_type {self.model_type!r}: {', '.join(unknown)}"
            )

    def convert_name(self, name: str) -> str | None:
        """HF name for `name`, or None when the entry is dropped (not a weight). A tied output
        keeps its name: the merge compares it with the embedding and stores it once."""
        if self.is_skipped(name):
            return None
        return self.to_hf_name(name)

    def needs_transform(self, hf_name: str) -> bool:
        """True when the tensor stored under `hf_name` must be reordered for HF."""
        return _abstract(hf_name)[0] in self.rope_permuted

    def transform(self, hf_name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
        """The tensor in HF layout (a new tensor when reordered, `tensor` itself otherwise)."""
        heads_key = self.rope_permuted.get(_abstract(hf_name)[0])
        if heads_key is None:
            return tensor
        n_heads = config_value(config, heads_key)
        if heads_key == "num_key_value_heads" and n_heads is None:
            n_heads = config_value(config, "num_attention_heads")
        if n_heads is None:
            raise CheckpointError(f"config.json has no {heads_key}; needed to convert {hf_name}")
        return interleaved_to_half(tensor, int(n_heads), what=hf_name)


ADAPTERS: dict[str, StateDictAdapter] = {
    "llama": StateDictAdapter(
        "llama", tables.LLAMA_NAMES, rope_permuted=tables.LLAMA_ROPE_PERMUTED
    ),
    "qwen3": StateDictAdapter("qwen3", tables.QWEN3_NAMES),
}


def get_adapter(model_type: str) -> StateDictAdapter:
    """The adapter for an HF config's `model_type`; ShardforgeError listing supported types."""
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise ShardforgeError(
            f"no torchtitan name adapter for model_type {model_type!r} (from config.json); "
            f"supported: {', '.join(sorted(ADAPTERS))}"
        )
    return adapter
