"""Run a function on N real CPU ranks (gloo process group), for tests and benchmarks.

    from helpers.dist import run_on_ranks
    run_on_ranks(my_fn, 3, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank

`my_fn` must be importable (a module-level function): the ranks are forked from the fork
server of `helpers.preloaded` (torch, transformers and shardforge imported once per test
process, not ~5 CPU-s again in every rank); `run_on_spawned_ranks` starts each in a fresh
interpreter instead (a test whose rank must import things itself). The process group is
initialised before `my_fn` runs and destroyed after.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _entry(
    rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    from shardforge.io.dist import finish_together

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    # A FileStore rendezvous: no TCP port to pick, so concurrent test workers cannot collide.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # every rank out of its last gloo collective before any leaves (a barrier here let a
        # fast rank's teardown abort a peer still inside it: SIGABRT, "terminate called
        # without an active exception", seen under load)
        finish_together()
    except BaseException:
        if dist.is_initialized():  # `fn` may have left it already: keep its own error
            dist.destroy_process_group()
        raise
    # then leave without tearing gloo down: its teardown racing a peer's exit still aborted a
    # rank now and then on a loaded machine, and a finished rank has nothing left to release
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call fn(rank, world_size, *args) on `world_size` CPU processes forked from the
    preloaded fork server (`helpers.preloaded`); raise on failure, as `run_on_spawned_ranks`."""
    from helpers.preloaded import run_on_preloaded_ranks

    run_on_preloaded_ranks(fn, world_size, *args)


def run_on_spawned_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call fn(rank, world_size, *args) on `world_size` spawned CPU processes; raise on failure.

    A failed rank's traceback reaches the caller in the exception; torch's file that carried
    it (pytorch-errorfile-*.pickle, in the temporary folder, which torch never removes) is
    removed here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="shardforge-ranks-") as tmp:
        ranks = mp.start_processes(
            _entry,
            args=(world_size, str(Path(tmp) / "store"), fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        join_ranks(ranks)


def join_ranks(ranks: Any) -> None:
    """Wait for ranks torch's `start_processes(join=False)` started; raise as `run_on_ranks`
    does when one failed (torch's ProcessRaisedException / ProcessExitedException), the
    others then ended; torch's error files removed."""
    try:
        while not ranks.join():
            pass
    finally:
        for name in ranks.error_files:
            Path(name).unlink(missing_ok=True)
