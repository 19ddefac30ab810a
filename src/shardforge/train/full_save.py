"""FULL_STATE_DICT's final save: the whole model as Hugging Face weights in the run's output_dir.

    save_full_model(output_dir, model, model_config)   every rank (the gather is a collective)
      full_model_tensors(...)   rank 0: the tensors to store (floating ones in the model's dtype),
                                then under the names save_pretrained writes (saved_state_dict)
      write_hf_weights(...)     rank 0: the one writer of the weight files (the seam the shared
                                Hugging Face directory sink takes over)

output_dir already holds the run (config.json, the tokenizer, metrics, checkpoints), so the
weights cannot be published as one new directory. They are published into it instead, in an
order a reader can trust: every shard is written in a hidden temporary place inside output_dir
(`io.publish.atomic_file`) and fsynced; only when all are complete is the previous save's index
removed, with any weight file of the previous save that this one does not rewrite; then each
shard is renamed into place and output_dir fsynced, and the index, fsynced, comes last. An
error or a crash while the shards are written leaves output_dir as it was (an earlier complete
save included); a reader never sees an index before every shard it lists is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardforge.io.fs import fsync_dir
from shardforge.io.publish import atomic_file
from shardforge.keymap.conversion import saved_state_dict

log = logging.getLogger("shardforge")

INDEX = "model.safetensors.index.json"
# the weight files of a save_pretrained-style directory (single file or shards)
WEIGHT_FILE = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def save_full_model(
    output_dir: Path, model: torch.nn.Module, model_config: Any, max_shard_size: str = "5GB"
) -> None:
    """Gather the full model on rank 0 (every rank calls this) and write it into output_dir as
    Hugging Face weights: `model.safetensors`, or shards of at most `max_shard_size` and
    `model.safetensors.index.json`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return
    # under the names save_pretrained writes (fused MoE experts per expert, as the base's)
    tensors = saved_state_dict(model, full_model_tensors(full, model, model_config))
    files = write_hf_weights(output_dir, tensors, max_shard_size)
    log.info("saved the full model to %s (%d file(s))", output_dir, len(files))


def model_dtype(model_config: Any) -> torch.dtype:
    """The dtype the config names (`dtype`, or transformers 4's `torch_dtype`); float32 if none."""
    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), torch.float32)


def full_model_tensors(
    full: dict[str, Any], model: torch.nn.Module, model_config: Any
) -> dict[str, torch.Tensor]:
    """The tensors to store: a tied pair once (as `save_pretrained`), floating tensors in the
    model's dtype; integer and bool tensors (buffers) keep theirs."""
    from shardforge.keymap.keys import check_tied_copies, stored_once, tied_pairs

    dtype = model_dtype(model_config)
    tied = tied_pairs(model, model_config)
    weights = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    check_tied_copies(tied, weights, lambda t: t, "the model's full state dict")
    return {
        k: (weights[k].to(dtype) if weights[k].is_floating_point() else weights[k])
        .detach()
        .contiguous()
        for k in stored_once(weights, tied)
    }


def write_hf_weights(
    output_dir: Path, tensors: dict[str, torch.Tensor], max_shard_size: str
) -> list[str]:
    """Write `tensors` as the weight files of the Hugging Face directory `output_dir` (which
    may hold other files, and an earlier save); return the file names, the index last.

    Every file is written and fsynced in a hidden temporary place (`atomic_file`); the renames
    come once all are complete, as the contexts close: the shards in order (output_dir fsynced
    after each), the index last."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import torch as st

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    files = [*split.filename_to_tensors, *([INDEX] if split.is_sharded else [])]
    with contextlib.ExitStack() as publish:
        # entered in reverse, so closed (renamed into output_dir) in order, the index last
        temp = {
            name: publish.enter_context(atomic_file(output_dir / name, overwrite=True)) / name
            for name in reversed(files)
        }
        for name, keys in split.filename_to_tensors.items():
            st.save_file({k: tensors[k] for k in keys}, str(temp[name]), metadata={"format": "pt"})
            _fsync(temp[name])
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            temp[INDEX].write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            _fsync(temp[INDEX])
        _retract_previous(output_dir, set(files))
    return files


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _retract_previous(output_dir: Path, rewritten: set[str]) -> None:
    """Once the new files are complete, before they are renamed in: remove the previous save's
    index (it may list shard names the new save reuses), then its weight files the new save
    does not rewrite (a stale `model.safetensors` would be loaded instead of new shards)."""
    old = [p for p in output_dir.iterdir() if WEIGHT_FILE.match(p.name) and p.name not in rewritten]
    for path in [output_dir / INDEX, *old]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fsync_dir(output_dir)
