"""Per-rank DTensor files over a 2x2 device mesh, written once by 4 real gloo ranks (one launch):

    root = mesh_rank_files(tmp_path_factory)     # shared by every test that asks

* ``tp/``: a tiny Llama sharded as FSDP2 + tensor parallelism (``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` over the ``tp`` mesh dimension, ``fully_shard`` over
  ``dp``), each rank's ``model.state_dict()`` saved with ``torch.save`` as verl names it: q/k/v
  and gate/up hold ``(_StridedShard(0), Shard(0))``, o/down ``(Shard(0), Shard(1))``, the rest
  ``Shard(0)`` on the ``dp`` sub-mesh (the ``tp`` ranks hold copies); the original is
  ``base/model.safetensors``;
* ``hsdp/``: the same model under HSDP (``(Replicate(), Shard(0))``, the replicas' copies equal);
* ``placements/``: named tensors with every placement mix over the 2x2 mesh (`PLACED`), cut by
  torch's own ``distribute_tensor``, with the full tensors in ``placements.pt``;
* ``partial/``: a tensor with a ``Partial`` placement (refused);
* ``diverged/``: a ``(Replicate(), Shard(0))`` tensor whose copy on rank 3 differs;
* ``uneven/``: ``(_StridedShard(0, sf=2), Shard(0))`` of 7 rows (refused: not provable).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.shared import shared_folder
from helpers.tiny import make_model

WORLD = 4
MESH = (2, 2)
# sizes divisible by the 4 ranks where tensor parallelism cuts them (heads, kv heads, MLP)
SHAPES: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 96, "vocab_size": 331}
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
# name -> (shape, dtype, placements as (kind, dim, split factor) per mesh dim)
PLACED: dict[str, tuple[tuple[int, ...], str, tuple[tuple[str, int, int], ...]]] = {
    "replicate_shard": ((9, 5), "float32", (("R", 0, 1), ("S", 0, 1))),
    "shard_replicate": ((6, 7), "bfloat16", (("S", 1, 1), ("R", 0, 1))),
    "shard_shard": ((7, 9), "float32", (("S", 0, 1), ("S", 1, 1))),
    "shard0_shard0": ((10, 3), "float16", (("S", 0, 1), ("S", 0, 1))),
    "strided_shard": ((8, 4), "float32", (("SS", 0, 2), ("S", 0, 1))),
    "strided_alone": ((8, 3), "float32", (("SS", 0, 2), ("R", 0, 1))),
    "fp8_shard_shard": ((8, 6), "float8_e4m3fn", (("S", 1, 1), ("S", 0, 1))),
    "int_replicated": ((5,), "int64", (("R", 0, 1), ("R", 0, 1))),
}


def _placements(spec: tuple[tuple[str, int, int], ...]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kinds = {"R": lambda d, f: Replicate(), "S": lambda d, f: Shard(d)}
    kinds["SS"] = lambda d, f: _StridedShard(d, split_factor=f)
    return [kinds[k](d, f) for k, d, f in spec]


def placed_tensors() -> dict[str, torch.Tensor]:
    """The full tensors of `PLACED` (the same on every rank: seeded)."""
    g = torch.Generator().manual_seed(11)
    out = {}
    for name, (shape, dtype, _) in PLACED.items():
        if dtype == "int64":
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g).to(getattr(torch, dtype))
    return out


def _save(state: dict[str, Any], folder: Path, rank: int) -> None:
    folder.mkdir(exist_ok=True)
    torch.save(state, folder / f"model_world_size_{WORLD}_rank_{rank}.pt")


def _save_tp(rank: int, model_dir: str, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _save(model.state_dict(), root / "tp", rank)


def _save_hsdp(rank: int, model_dir: str, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _save(model.state_dict(), root / "hsdp", rank)


def _save_placed(rank: int, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", MESH)
    full = placed_tensors()
    state = {
        name: distribute_tensor(full[name], mesh, _placements(spec), src_data_rank=None)
        for name, (_, _, spec) in PLACED.items()
    }
    _save(state, root / "placements", rank)
    if rank == 0:
        torch.save(full, root / "placements.pt")
    one = torch.arange(12, dtype=torch.float32).view(6, 2)
    _save(
        {
            "ok": state["shard_shard"],
            "summed": DTensor.from_local(one, mesh, [Partial(), Shard(0)]),
        },
        root / "partial",
        rank,
    )
    diverged = distribute_tensor(one, mesh, [Replicate(), Shard(0)], src_data_rank=None)
    if rank == 3:
        diverged = DTensor.from_local(diverged.to_local() + 1, mesh, [Replicate(), Shard(0)])
    _save({"buffer": diverged}, root / "diverged", rank)
    seven = torch.arange(14, dtype=torch.float32).view(7, 2)
    strided = [_StridedShard(0, split_factor=2), Shard(0)]
    _save(
        {"uneven": distribute_tensor(seven, mesh, strided, src_data_rank=None)},
        root / "uneven",
        rank,
    )


def _write(rank: int, world_size: int, model_dir: str, root: str) -> None:
    _save_tp(rank, model_dir, Path(root))
    _save_hsdp(rank, model_dir, Path(root))
    _save_placed(rank, Path(root))


def build(root: Path) -> None:
    root.mkdir(parents=True)
    model_dir = make_model(root / "base", "llama", seed=4, **SHAPES)
    run_on_ranks(_write, WORLD, str(model_dir), str(root))


def mesh_rank_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folders above, built once per test run (see the module docstring)."""
    return shared_folder(tmp_path_factory, "mesh-rank-files", build)
