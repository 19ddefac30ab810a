"""The process group and device of one training rank; output_dir's lock (rank 0 holds it)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardforge.config.schema import ShardforgeConfig, names_object_storage
from shardforge.errors import ConfigError
from shardforge.io.lock import lock_inside, output_lock

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
MESH_DIMS = ("dp_replicate", "dp_shard")


def under_torchrun() -> bool:
    return any(name in os.environ for name in TORCHRUN_ENV)


def output_dir_lock(
    cfg: ShardforgeConfig, rt: Runtime
) -> contextlib.AbstractContextManager[object]:
    """One run at a time writes an output_dir: rank 0 holds output_dir/.shardforge.lock for the
    run (`io.lock`; the other ranks write there only after rank 0 has). An s3:// output_dir has
    no lock (docs/storage.md)."""
    if not rt.is_main or names_object_storage(cfg.output_dir):
        return contextlib.nullcontext()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = f"shardforge train (rank 0 of {rt.world_size})"
    return output_lock(lock_inside(out), out, command, cfg.take_over_lock, "--take_over_lock")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Runtime:
    """Join the process group torchrun describes (or make a one-rank group without torchrun).

    NCCL on GPUs, gloo on CPU.
    """
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
    elif under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ["LOCAL_RANK"])
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    else:
        rank, world, local = 0, 1, 0
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return Runtime(rank, world, local, device)


def mesh_shape(
    cfg: ShardforgeConfig, world_size: int, local_world_size: int | None = None
) -> tuple[int, ...]:
    """(world,) for FULL_SHARD, or (replicate, shard) for HSDP; a size that does not fit the
    world size is a ConfigError naming its key.

    The shard size is `dp_shard_size`, else `world / dp_replicate_size`, else (with
    `fsdp.hybrid_shard`) the ranks of one machine; one replica is plain FULL_SHARD.
    """
    shard, replicate = cfg.dp_shard_size, cfg.dp_replicate_size
    if shard is not None and replicate is not None and shard * replicate != world_size:
        raise ConfigError(
            "dp_replicate_size",
            [
                f"dp_replicate_size x dp_shard_size = {replicate} x {shard} = "
                f"{replicate * shard}, but the world size is {world_size}"
            ],
        )
    for key, size in (("dp_shard_size", shard), ("dp_replicate_size", replicate)):
        if size is not None and world_size % size:
            raise ConfigError(key, [f"{size} does not divide the world size {world_size}"])
    if shard is None and replicate is not None:
        shard = world_size // replicate
    if shard is None and cfg.fsdp.hybrid_shard:
        shard = local_world_size or world_size
        if world_size % shard:
            raise ConfigError(
                "fsdp.hybrid_shard",
                [
                    f"the {shard} ranks of one machine do not divide the world size "
                    f"{world_size}; set dp_shard_size"
                ],
            )
    if shard is None or shard == world_size:
        return (world_size,)
    return (world_size // shard, shard)


def local_world_size() -> int | None:
    """Ranks on this machine, as torchrun tells them (None outside torchrun)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def device_mesh(rt: Runtime, shape: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh over all ranks, or the 2-D (dp_replicate, dp_shard) mesh of HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if len(shape) == 1:
        return init_device_mesh(rt.device.type, shape)
    return init_device_mesh(rt.device.type, shape, mesh_dim_names=MESH_DIMS)
