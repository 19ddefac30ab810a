"""The saved formats `merge_bench.py --format` writes: the same synthetic Llama (the same values,
rank by rank) saved by each trainer's own saving API on gloo ranks.

- ``dcp``: ``dcp.save({"model": state})`` (HF Trainer / accelerate), written by merge_bench.py
  itself in parts of about 1 GiB per rank (checkpoints larger than RAM);
- ``dcp-ranks``: ``dcp.save({"model": state}, use_collectives=False)``: ``__R_0.distcp`` and
  ``__R.metadata`` per rank, no global ``.metadata``;
- ``accelerate-bin``: accelerate's ``save_fsdp_model(plugin, accelerator, model, dir,
  use_dcp=False)`` of a real FSDP2 (``fully_shard``) LlamaForCausalLM: one
  ``pytorch_model_fsdp_0_rank<R>.bin`` per rank. The model is built on the meta device and
  sharded before it is materialised (``to_empty``), so a rank holds only its shard;
- ``dcp-safetensors``: ``dcp.save(state, storage_writer=HuggingFaceStorageWriter(dir,
  save_distributed=True))``: ``shard-0000<R+1>-model-00001-of-00001.safetensors`` per rank;
- ``dcp-safetensors-consolidated``: the same with ``enable_consolidation=True`` (torchtitan's
  ``last_save_in_hf``): the shards in ``sharded/`` and torch's consolidated
  ``model-*.safetensors`` beside them; the merge reads the consolidated files.

Every format but ``dcp`` is written in one save per rank (as a trainer writes it): a rank holds
its whole shard, and DCP's safetensors writer also its serialized bytes, so these formats need
about 2x the checkpoint's size in RAM on the machine that writes them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

FORMATS = (
    "dcp",
    "dcp-ranks",
    "accelerate-bin",
    "dcp-safetensors",
    "dcp-safetensors-consolidated",
)
# the folder `--checkpoint` names, under the benchmark's root
CHECKPOINT_DIRS = {
    "dcp": "out/checkpoint-1/pytorch_model_fsdp_0",
    "dcp-ranks": "dcp-ranks/checkpoint-1/pytorch_model_fsdp_0",
    "accelerate-bin": "accelerate-bin/checkpoint-1",
    "dcp-safetensors": "dcp-safetensors/step-1",
    "dcp-safetensors-consolidated": "dcp-safetensors-consolidated/step-1",
}
DONE = ".bench-complete"  # beside the format's top folder, never inside the checkpoint


def checkpoint_dir(root: Path, fmt: str) -> Path:
    return root / CHECKPOINT_DIRS[fmt]


def checkpoint_files(root: Path, fmt: str) -> list[Path]:
    """Every file of the format's checkpoint (to evict, to size)."""
    ckpt = checkpoint_dir(root, fmt)
    return sorted(p for p in ckpt.rglob("*") if p.is_file())


def fill(local: Any, block: Any) -> None:
    """`local` filled with `block` tiled from its start (content does not matter to a merge,
    and drawing gigabytes of random numbers would dominate the generator's time)."""
    flat = local.view(-1)
    for at in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - at)
        flat[at : at + n] = block[:n]


def rank_block(rank: int, dtype: str) -> Any:
    """The values every tensor of `rank` is tiled from (the same in every format)."""
    import torch

    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(1 << 22, generator=gen).to(getattr(torch, dtype))


def sharded_state(
    rank: int, world: int, names: list[str], shapes: list[list[int]], dtype: str
) -> dict[str, Any]:
    """This rank's dim-0 shards (torch.chunk's split, as FSDP2's) of the named tensors, as
    DTensors over a 1-D mesh of `world` ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    block = rank_block(rank, dtype)
    state: dict[str, Any] = {}
    for name, shape in zip(names, shapes, strict=True):
        rows = shape[0]
        per = -(-rows // world)  # torch.chunk semantics: ceil, the last ranks may get less or none
        start, stop = min(rank * per, rows), min((rank + 1) * per, rows)
        local = torch.empty((stop - start, *shape[1:]), dtype=getattr(torch, dtype))
        fill(local, block)
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return state


def _save_dcp_format(
    rank: int,
    world: int,
    fmt: str,
    folder: str,
    names: list[str],
    shapes: list[list[int]],
    dtype: str,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    state = sharded_state(rank, world, names, shapes, dtype)
    if fmt == "dcp-ranks":
        dcp.save({"model": state}, checkpoint_id=folder, use_collectives=False)
        return
    writer = HuggingFaceStorageWriter(
        folder,
        save_distributed=True,
        enable_consolidation=fmt == "dcp-safetensors-consolidated",
    )
    dcp.save(state, storage_writer=writer)


def _save_accelerate_bin(
    rank: int, world: int, folder: str, config: dict[str, Any], dtype: str
) -> None:
    """A meta-device LlamaForCausalLM, fully_shard-ed per layer and whole, materialised (only
    this rank's shards), filled as `sharded_state` fills, and saved by accelerate."""
    import warnings

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    block = rank_block(rank, dtype)
    with torch.no_grad():
        for p in model.parameters():
            fill(p.to_local(), block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(cpu=True)  # save_fsdp_model logs through accelerate's state
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"
        )
        save_fsdp_model(plugin, accelerator, model, folder, use_dcp=False)


def make_format(
    root: Path,
    fmt: str,
    config: dict[str, Any],
    params: list[tuple[str, tuple[int, ...]]],
    dtype: str,
    ranks: int,
) -> Path:
    """Write the checkpoint of `fmt` (not ``dcp``) under `root` unless it is complete; return
    the folder to merge."""
    import shutil
    import subprocess
    import sys

    from helpers.dist import run_on_ranks

    top = root / CHECKPOINT_DIRS[fmt].split("/")[0]
    ckpt = checkpoint_dir(root, fmt)
    if (top / DONE).exists():
        print(f"reusing {fmt} checkpoint {ckpt}", file=sys.stderr)
        return ckpt
    shutil.rmtree(top, ignore_errors=True)
    ckpt.mkdir(parents=True)
    t0 = time.perf_counter()
    if fmt == "accelerate-bin":
        run_on_ranks(_save_accelerate_bin, ranks, str(ckpt), config, dtype)
    else:
        names = [n for n, _ in params]
        shapes = [list(s) for _, s in params]
        run_on_ranks(_save_dcp_format, ranks, fmt, str(ckpt), names, shapes, dtype)
    subprocess.run(["sync"], check=False)
    (top / DONE).write_text("")
    print(f"  wrote {fmt} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return ckpt
