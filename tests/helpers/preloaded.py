"""Gloo ranks forked from multiprocessing's fork server, which imported the training code once
(a spawned rank of `helpers.dist.run_on_ranks` spends ~5 CPU-s importing torch, transformers
and torchao again), for tests whose subject is what the ranks do, not how they start:

    run_on_preloaded_ranks(my_fn, 3, arg1)      # as run_on_ranks: my_fn(rank, world, arg1)
    ranks = start_preloaded_ranks(my_fn, 2, arg1, store=folder)   # at once; ranks.processes
    join_ranks(ranks)
    stop_fork_server()                          # at the end of the module (it waits for it)

Each rank is a process of its own with its own gloo process group (`helpers.dist._entry`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.dist import _entry

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

    server: Any = forkserver._forkserver
    if server._forkserver_pid is None:  # none running: nothing to end, no folder to remove
        return
    server._stop()
    # the server's socket was in multiprocessing's temporary folder (made once per process,
    # removed at exit): remove it now, as pytest removes TMPDIR (the session's) before the exit
    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
        if finalizer._callback is util._remove_temp_dir:  # type: ignore[attr-defined]
            finalizer()
    process.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]
