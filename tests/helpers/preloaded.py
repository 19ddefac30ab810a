"""Processes forked from multiprocessing's fork server, which imported torch, transformers and
shardforge's merge and training code once per test process (a spawned rank of
`helpers.dist.run_on_ranks` spends ~5 CPU-s importing them again), for tests whose subject is
what the ranks do, not how they start:

    run_on_preloaded_ranks(my_fn, 3, arg1)      # as run_on_ranks: my_fn(rank, world, arg1)
    ranks = start_preloaded_ranks(my_fn, 2, arg1, store=folder)   # at once; ranks.processes
    join_ranks(ranks)
    start_preloaded(fn, 2, (a, b))              # torch's start_processes: fn(i, a, b)
    stop_fork_server()                          # optional: it waits for the server to end

Each rank is a process of its own with its own gloo process group (`helpers.dist._entry`),
started with this process's environment and output as they are at the call. The server is
one thread, so forking it is safe (forking the test process is not: a thread pool an earlier
merge left there, blake3's, stays locked in the child).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.dist import _entry, join_ranks

__all__ = [
    "join_ranks",
    "kill_ranks_when",
    "run_on_preloaded_ranks",
    "start_preloaded",
    "start_preloaded_ranks",
    "stop_fork_server",
]

# what the ranks of the merge and training tests import, loaded once by the fork server
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "shardforge.config",
    "shardforge.merge.api",
    "shardforge.merge.on_ranks",
    "shardforge.train.loop",
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
    from the fork server (started by the first call in this process, with `PRELOAD`
    imported); each starts with this process's environment and output as they are now."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts
    _server_folder()
    return mp.start_processes(
        _with_env,
        args=(os.getpid(), dict(os.environ), fn, *args),
        nprocs=nprocs,
        join=join,
        start_method="forkserver",
    )


def start_preloaded_ranks(fn: Callable[..., Any], world_size: int, *args: Any, store: str) -> Any:
    """The gloo ranks of `run_on_preloaded_ranks`, started at once: torch's ProcessContext
    (`processes`: each rank's multiprocessing.Process; `join_ranks` waits for them). `store`:
    an existing folder for the rendezvous, kept until the ranks have ended."""
    store_file = str(Path(store) / "store")
    return start_preloaded(_entry, world_size, (world_size, store_file, fn, args), join=False)


def kill_ranks_when(ranks: Any, ready: Callable[[], bool], what: str) -> None:
    """Once `ready()` holds (checked every millisecond, for at most 240 s, while every rank
    lives), SIGKILL every rank of `start_preloaded_ranks` and reap them (`what`: the moment,
    for the failure message)."""
    import signal

    import pytest
    from torch.multiprocessing import ProcessExitedException

    deadline = time.monotonic() + 240
    while not ready():
        assert all(p.is_alive() for p in ranks.processes), f"training ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)
    for rank in ranks.processes:
        os.kill(rank.pid, signal.SIGKILL)
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        join_ranks(ranks)


def run_on_preloaded_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """`run_on_ranks`, with the ranks forked from the fork server: they skip the imports."""
    with tempfile.TemporaryDirectory(prefix="shardforge-ranks-") as tmp:
        join_ranks(start_preloaded_ranks(fn, world_size, *args, store=tmp))


def _server_folder() -> None:
    """The fork server listens on a socket in multiprocessing's temporary folder, which
    multiprocessing would make under TMPDIR (this session's pytest folder) and remove as this
    process exits: after pytest has removed that folder (a traceback at exit). Made here, it
    is removed at exit (or by `stop_fork_server`) if it is still there."""
    import atexit
    from multiprocessing import process

    config = getattr(process.current_process(), "_config")  # noqa: B009
    if config.get("tempdir") is None:
        # under TMPDIR (the session's folder), not a test's own temporary folder
        config["tempdir"] = tempfile.mkdtemp(prefix="pymp-", dir=os.environ.get("TMPDIR"))
        atexit.register(shutil.rmtree, config["tempdir"], ignore_errors=True)


def stop_fork_server() -> None:
    """End the fork server (if this process started one) and wait for it: nothing is left
    running, and its CPU time (its ranks' too) counts as this process's children's. A later
    call starts a new one."""
    from multiprocessing import forkserver, process

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is None:  # none running
        return
    server._stop()
    config = getattr(process.current_process(), "_config")  # noqa: B009
    folder = config.pop("tempdir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
