"""A LoRA training checkpoint in the merge: shardforge's (adapter and modules_to_save copies
only) or a PEFT-wrapped model's whole state dict as HF Trainer / accelerate / Axolotl save it
(``base_layer`` / ``lora_A`` / ``lora_B`` / ``modules_to_save`` names).

Two outputs:

* default: a PEFT adapter directory (`adapter_sources`): ``adapter_model.safetensors`` under
  the names `PeftModel.save_pretrained` writes and ``adapter_config.json`` (the checkpoint's own,
  when its step folder has one, else the run's own in the folder holding the step, as `train`
  and Axolotl export it to output_dir, else made from the config's `adapter: lora` keys);
* ``--merge_lora``: the complete model with the adapter fused in (`fused_sources`): the base
  tensors from the checkpoint when it holds them, else from `base_model`'s safetensors, each
  adapted weight a `FusedLoraSource` (``W + scale * B @ A`` in float32), streamed like any
  other merge.

Either way the adapter is checked against the meta-device architecture first
(`shardforge.merge.lora.fuse_sources`: targeted modules, factor shapes, tied copies).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from shardforge.config.peft import ADAPTER_CONFIG, adapter_config_json, lora_config
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import CheckpointError, MergeError
from shardforge.formats.sources import TensorSource
from shardforge.io.files import open_regular
from shardforge.keymap.keys import clean_name
from shardforge.keymap.lora import PEFT_PREFIX, LoraNames, split_adapter_names, split_model_names
from shardforge.keymap.lora_settings import LoraSettings
from shardforge.layouts.catalog import step_folder
from shardforge.merge.check import ExpectedModel

MAX_ADAPTER_CONFIG = 1 << 20


@dataclass(frozen=True)
class LoraCheckpoint:
    """A LoRA checkpoint's tensors split by role, and the adapter settings."""

    names: LoraNames
    tensors: dict[str, TensorSource]  # the names in `names` -> their sources
    settings: LoraSettings
    adapter_config: dict[str, Any]  # adapter_config.json as written
    config_source: str  # where the adapter settings came from

    @property
    def holds_base(self) -> bool:
        """The checkpoint has the base weights too (a PEFT-wrapped model's full state dict)."""
        return bool(self.names.base)


def _best_split(
    keys: Mapping[str, str], expected: ExpectedModel, source: str
) -> tuple[LoraNames, dict[str, str]]:
    """`split_model_names` under the wrapper prefix (``model.`` from accelerate's
    ``{"model": state_dict}``, ...) that puts the most names on the architecture's; or the
    adapter file's names (`split_adapter_names`: what ``get_peft_model_state_dict`` gives,
    accelerate's ``adapter_only`` save)."""
    cleaned = {clean_name(k): k for k in keys}
    prefixes = {""} | {n.split(".", 1)[0] + "." for n in cleaned if "." in n}
    best: tuple[int, LoraNames, dict[str, str]] | None = None
    error: CheckpointError | None = None
    for prefix in sorted(prefixes, key=len):
        stripped = {n[len(prefix) :]: k for n, k in cleaned.items() if n.startswith(prefix)}
        if len(stripped) != len(cleaned):
            continue
        for split in (split_model_names, split_adapter_names):
            try:
                names = split(stripped, source=source)
            except CheckpointError as exc:
                error = error or exc
                continue
            hits = sum(f"{m}.{p.weight}" in expected.shapes for m, p in names.pairs.items())
            hits += sum(n in expected.shapes for n in [*names.base, *names.replacements])
            if best is None or hits > best[0]:
                best = (hits, names, stripped)
    if best is None:
        assert error is not None  # the unprefixed names were tried
        raise error
    return best[1], best[2]


def _adapter_config_folders(model_dir: Path) -> list[Path]:
    """Where a checkpoint's adapter_config.json may be: beside the model (HF Trainer writes it
    into the step folder), else in the run folder holding the step folder (the adapter the run
    exported to its output_dir: `train`, Axolotl)."""
    folders = [model_dir, model_dir.parent]
    found = step_folder(PurePath(model_dir))
    if found is not None and len(found[2].parts) <= 1:  # the step folder or its model folder
        step_dir = model_dir.parent if found[2].parts else model_dir
        folders.append(step_dir.parent)
    return list(dict.fromkeys(folders))


def _checkpoint_adapter_config(model_dir: Path) -> tuple[dict[str, Any], str] | None:
    """The adapter_config.json beside a PEFT model's checkpoint, else the run's own, if any."""
    for folder in _adapter_config_folders(model_dir):
        path = folder / ADAPTER_CONFIG
        if path.is_file():
            fd = open_regular(path, folder)
            with open(fd, "rb") as f:
                data = f.read(MAX_ADAPTER_CONFIG + 1)
            if len(data) > MAX_ADAPTER_CONFIG:
                raise CheckpointError(f"{path}: larger than {MAX_ADAPTER_CONFIG} bytes")
            try:
                parsed = json.loads(data)
            except ValueError as exc:
                raise CheckpointError(f"{path}: not JSON ({str(exc)[:100]})") from None
            return parsed, str(path)
    return None


def open_lora(
    named: Mapping[str, TensorSource],
    model_dir: Path,
    cfg: ShardforgeConfig,
    expected: ExpectedModel,
) -> LoraCheckpoint:
    """Split a LoRA checkpoint's tensors (`named`: checkpoint key -> source) and read its
    adapter settings (the checkpoint's adapter_config.json, else the run's own in the folder
    holding the step, else the config's lora keys)."""
    source = str(model_dir)
    names, by_input = _best_split({k: k for k in named}, expected, source)
    tensors = {n: named[by_input[n]] for n in by_input}
    found = _checkpoint_adapter_config(model_dir)
    if found is not None:
        data, where = found
    elif cfg.adapter in ("lora", "qlora"):
        tied = bool(expected.tied)
        config = lora_config(cfg, cfg.base_model, tied, expected.linear_names)
        data = adapter_config_json(config)
        where = "the config's adapter / lora_* keys"
    else:
        raise MergeError(
            f"{model_dir}: holds a LoRA adapter, and neither the checkpoint (nor its run "
            f"folder) has an {ADAPTER_CONFIG} nor the config sets adapter: lora; add the "
            "training run's adapter and lora_* keys to the config"
        )
    settings = LoraSettings.from_adapter_config(data, where)
    return LoraCheckpoint(names, tensors, settings, data, where)


def adapter_sources(lora: LoraCheckpoint) -> dict[str, TensorSource]:
    """The adapter file's tensors under the names `PeftModel.save_pretrained` writes."""
    out: dict[str, TensorSource] = {}
    for module, pair in sorted(lora.names.pairs.items()):
        kind = "lora_embedding" if pair.embedding else "lora"
        leaf = "" if pair.embedding else ".weight"
        out[f"{PEFT_PREFIX}{module}.{kind}_A{leaf}"] = lora.tensors[pair.a]
        out[f"{PEFT_PREFIX}{module}.{kind}_B{leaf}"] = lora.tensors[pair.b]
    for hf, name in sorted(lora.names.replacements.items()):
        out[f"{PEFT_PREFIX}{hf}"] = lora.tensors[name]
    return out
