"""Run a function on N real CPU ranks (gloo process group), for tests and benchmarks.

    from shardforge.testing.dist import run_on_ranks
    run_on_ranks(my_fn, 3, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank

`my_fn` must be importable (a module-level function) because ranks are started with `spawn`.
The process group is initialised before `my_fn` runs and destroyed after.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call fn(rank, world_size, *args) on `world_size` spawned CPU processes; raise on failure."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _entry,
        args=(world_size, free_port(), fn, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
