"""Ending a job of several ranks cleanly."""

from __future__ import annotations

import torch.distributed as dist

from shardforge.errors import ShardforgeError

_CALLS = [0]  # calls of `finish_together` in this process


def finish_together(timeout_s: float = 300.0) -> None:
    """Return once every rank got here, without a gloo collective in flight: each rank
    counts itself in the rendezvous store and waits for the others there. (A rank that tears
    its process group down while a peer is still inside a gloo collective can abort that peer:
    "terminate called without an active exception".)"""
    import time

    from torch.distributed import distributed_c10d

    get_store = getattr(distributed_c10d, "_get_default_store", None)
    if get_store is None:  # an older or newer torch without it: a barrier is the next best
        dist.barrier()
        return
    store = get_store()
    world = dist.get_world_size()
    # every rank calls this in the same order: the n-th call of each meets on the n-th key
    _CALLS[0] += 1
    key = f"shardforge/finished/{_CALLS[0]}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise ShardforgeError("a rank did not reach the end of the job in time")
        time.sleep(0.01)
