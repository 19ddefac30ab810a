"""Run a function on N real CPU ranks (gloo process group), for tests and benchmarks.

    from helpers.dist import run_on_ranks
    run_on_ranks(my_fn, 3, arg1, arg2)   # my_fn(rank, world_size, arg1, arg2) on every rank

`my_fn` must be importable (a module-level function) because ranks are started with `spawn`.
The process group is initialised before `my_fn` runs and destroyed after.
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
        try:
            while not ranks.join():
                pass
        finally:
            for name in ranks.error_files:
                Path(name).unlink(missing_ok=True)


# what a training rank imports (seconds of CPU each time a process imports them)
TRAINING_MODULES = (
    "shardforge.config",
    "shardforge.train.loop",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
)


def run_on_preloaded_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, preload: tuple[str, ...] = TRAINING_MODULES
) -> None:
    """`run_on_ranks`, with the ranks forked from multiprocessing's fork server, which imported
    `preload` once (the first call in this process starts it): each rank is a process of its
    own with its own gloo process group, as a spawned one, without the seconds of imports.

    The fork server is started with this process's environment at that moment (later changes
    of os.environ do not reach the ranks); end it with `stop_fork_server` (or it ends with
    this process)."""
    with tempfile.TemporaryDirectory(prefix="shardforge-ranks-") as tmp:
        join_ranks(start_preloaded_ranks(fn, world_size, *args, store=tmp, preload=preload))


def start_preloaded_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    store: str,
    preload: tuple[str, ...] = TRAINING_MODULES,
) -> Any:
    """Start the ranks of `run_on_preloaded_ranks` and return at once: torch's ProcessContext
    (`processes`: each rank's multiprocessing.Process, pid and all; `join_ranks` waits for
    them). `store`: an existing folder for the rendezvous, kept until the ranks have ended."""
    import multiprocessing

    import torch.multiprocessing as mp

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # read only when the server starts
    return mp.start_processes(
        _entry,
        args=(world_size, str(Path(store) / "store"), fn, args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )


def join_ranks(ranks: Any) -> None:
    """Wait for the ranks of `start_preloaded_ranks`; raise as `run_on_ranks` does when one
    failed (torch's ProcessRaisedException / ProcessExitedException), the others then ended."""
    try:
        while not ranks.join():
            pass
    finally:
        for name in ranks.error_files:
            Path(name).unlink(missing_ok=True)


def stop_fork_server() -> None:
    """End the fork server of `run_on_preloaded_ranks` (if this process started one) and wait
    for it: nothing is left running, and its CPU time (its ranks' too) counts as this
    process's children's. A later call of `run_on_preloaded_ranks` starts a new one."""
    from multiprocessing import forkserver, process, util

    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    # the server's socket was in multiprocessing's temporary folder (made once per process,
    # removed at exit): remove it now, as pytest removes TMPDIR (the session's) before the exit
    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
        if finalizer._callback is util._remove_temp_dir:  # type: ignore[attr-defined]
            finalizer()
    process.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]
