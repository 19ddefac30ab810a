"""Rank files written by real gloo ranks the way LMMs-Engine's FSDP2 trainer and verl write
them: ``torch.save(model.state_dict(), f"model_world_size_{W}_rank_{R}.pt")`` on every rank of
a ``fully_shard``-ed Hugging Face model.

Imported by name (``from rank_helpers import ...``); the name is unique across the test tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.shared import shared_folder
from helpers.tiny import make_model

# hidden 70 (not divisible by 3 or 4), vocab 331 and intermediate 101 (divisible by neither 2
# nor 3): uneven shards, and empty-free but short last chunks
SHAPES: dict[str, Any] = {
    "vocab_size": 331,
    "hidden_size": 70,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "intermediate_size": 101,
}


def write_rank_files(
    rank: int,
    world_size: int,
    model_dir: str,
    out_dir: str,
    mesh_shape: tuple[int, ...],
    matrix_shard_dim: int,
) -> None:
    """Shard `model_dir` with FSDP2 over `mesh_shape` (HSDP when 2-D), matrices along
    `matrix_shard_dim`, and save each rank's state dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from transformers import AutoModelForCausalLM

    def placement(param: torch.nn.Parameter) -> Shard:
        return Shard(matrix_shard_dim if param.ndim == 2 else 0)

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    torch.save(model.state_dict(), f"{out_dir}/model_world_size_{world_size}_rank_{rank}.pt")


# the rank-file sets of the tests: name -> (world size, dtype, the dim matrices are sharded on)
RANK_SETS: dict[str, tuple[int, str, int]] = {
    "ranks_2_fp32": (2, "float32", 0),
    "shard_dim_1": (2, "float32", 1),
    "ranks_3_bf16": (3, "bfloat16", 0),
}


def shared_rank_files(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[Path, Path]:
    """(model_dir, rank_dir) of the set `name` of `RANK_SETS`: a tiny Llama whose sizes split
    unevenly over 2 and 3 ranks (FSDP2 shards dim 1 only evenly: then the default tiny sizes,
    all even, are used), saved by each rank. Written once per test run for every xdist worker,
    the sets of one world size in one launch of gloo ranks; read only."""
    world = RANK_SETS[name][0]
    root = shared_folder(tmp_path_factory, f"rank-files-{world}", partial(_write_sets, world))
    return root / name / "base", root / name / "ranks"


def _write_sets(world_size: int, root: Path) -> None:
    sets = []
    for name, (world, dtype, dim) in RANK_SETS.items():
        if world == world_size:
            shapes = SHAPES if dim == 0 else {"vocab_size": 331}
            model_dir = make_model(root / name / "base", "llama", dtype=dtype, seed=world, **shapes)
            (root / name / "ranks").mkdir()
            sets.append((str(model_dir), str(root / name / "ranks"), (world,), dim))
    run_on_ranks(_write_each, world_size, sets)


def _write_each(rank: int, world_size: int, sets: list[tuple[str, str, tuple[int], int]]) -> None:
    for model_dir, out_dir, mesh_shape, matrix_shard_dim in sets:
        write_rank_files(rank, world_size, model_dir, out_dir, mesh_shape, matrix_shard_dim)


def logits(model_dir: Path, state_dict: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits of the model in `model_dir` (weights replaced by `state_dict` when given)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    ids = torch.tensor([[1, 5, 9, 33, 120, 7, 250, 2], [1, 44, 45, 46, 47, 48, 49, 50]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def full_tensors(plan: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every full tensor of a rank-file plan, read the way the merge reads it."""
    from shardforge.formats.rankfiles.source import RankFileSource
    from shardforge.io.copy import ReadCache

    with ReadCache() as reader:
        return {key: RankFileSource(tp).read(reader) for key, tp in plan.items()}


def local_tensor(rank_file: Any, key: str) -> torch.Tensor:
    """One rank's local shard of `key` (only its bytes are read)."""
    import os

    from shardforge.formats.rankfiles.rank_file import read_local

    rec = rank_file.tensors[key]
    fd = os.open(rec.path, os.O_RDONLY)
    try:
        return read_local(fd, rec)
    finally:
        os.close(fd)
