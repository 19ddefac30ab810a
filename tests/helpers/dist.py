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


# what the ranks of the merge tests import, loaded once by multiprocessing's fork server
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "shardforge.merge.api",
    "shardforge.merge.on_ranks",
)


def _with_env(
    rank: int, parent: int, env: dict[str, str], fn: Callable[..., Any], *args: Any
) -> None:
    """In a process the fork server made: the starting process's stdout, stderr (pytest's
    capture of the test running now) and environment, then `fn`."""
    for fd in (1, 2):
        try:
            now = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(now, fd)
        os.close(now)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read TMPDIR again
    fn(rank, *args)


def start_preloaded(
    fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], join: bool = True
) -> Any:
    """`torch.multiprocessing.start_processes(fn, args, nprocs)`, with the processes forked
    from multiprocessing's fork server instead of spawned: the server imports `PRELOAD` once
    per test process (some 5 CPU-s a spawned process spends again), and each process forked
    from it starts with them, and with this process's environment and output as they are now
    (the server's are those of when it started). Still processes of their own; the server is one thread, so
    forking it is safe (forking the test process is not: a thread pool an earlier merge left
    there, blake3's, stays locked in the child). The server ends with the test process."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # before the server starts
    _server_folder()
    return mp.start_processes(
        _with_env,
        args=(os.getpid(), dict(os.environ), fn, *args),
        nprocs=nprocs,
        join=join,
        start_method="forkserver",
    )


def _server_folder() -> None:
    """The fork server listens on a socket in multiprocessing's temporary folder, which
    multiprocessing would make under TMPDIR (this session's pytest folder) and remove as this
    process exits: after pytest has removed that folder (a traceback at exit). Made here, it
    is removed at exit if it is still there; the server itself ends with this process."""
    import atexit
    import shutil
    from multiprocessing import process

    config = getattr(process.current_process(), "_config")  # noqa: B009
    if config.get("tempdir") is None:
        config["tempdir"] = tempfile.mkdtemp(prefix="pymp-")
        atexit.register(shutil.rmtree, config["tempdir"], ignore_errors=True)


def run_on_preloaded_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """`run_on_ranks`, with the ranks started by `start_preloaded`: they skip the imports."""
    with tempfile.TemporaryDirectory(prefix="shardforge-ranks-") as tmp:
        store = str(Path(tmp) / "store")
        ranks = start_preloaded(_entry, world_size, (world_size, store, fn, args), join=False)
        try:
            while not ranks.join():
                pass
        finally:
            for name in ranks.error_files:
                Path(name).unlink(missing_ok=True)
