"""The process group and device of one training rank."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def under_torchrun() -> bool:
    return any(name in os.environ for name in TORCHRUN_ENV)


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


def device_mesh(rt: Runtime) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rt.device.type, (rt.world_size,))
