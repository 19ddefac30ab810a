"""The launcher's side of a job of several ranks (torchrun), for training and the merge alike.

The launcher names a file in SHARDFORGE_RANK_ERROR_FILE; the first rank that stops on a user
error leaves its exit code and message there (`leave_rank_error`) and exits quietly, and the
launcher raises that error once (`raise_rank_error`) instead of every rank and torchrun
printing it.

Every process of the job dies with the one that started it (Linux: `PR_SET_PDEATHSIG`), so
that no rank outlives the command: `shardforge` -> torchrun's agent -> the ranks, each rank in
a session of its own (torchrun starts them so: a signal to the command's process group does
not reach them). `run_ranks` names its own pid in SHARDFORGE_LAUNCHER_PID; the agent and then
each rank call `die_with_launcher` first, which asks the kernel for SIGKILL when its parent
ends, checks that the parent is still the one named (it may have ended before the request),
and names itself for the processes it starts. Elsewhere than Linux there is no such request:
the ranks outlive a launcher killed with SIGKILL there (docs/train.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from shardforge.errors import ShardforgeError

log = logging.getLogger("shardforge")

# set by the launcher for the ranks: where the first rank that fails on a user error writes it
ERROR_FILE_ENV = "SHARDFORGE_RANK_ERROR_FILE"
# set by a launcher for the process it starts (the torchrun agent; the agent for its ranks)
LAUNCHER_PID_ENV = "SHARDFORGE_LAUNCHER_PID"
# prctl(2): the signal this process gets when the thread that started it ends
PR_SET_PDEATHSIG = 1
# how long an interrupted launcher lets torchrun stop its ranks before it kills it
STOP_SECONDS = 30.0


def run_ranks(cmd: list[str], env: dict[str, str], nproc: int) -> int:
    """Run the torchrun command `cmd` (`nproc` ranks on this machine); its exit status.
    OpenMP threads are split between the ranks unless OMP_NUM_THREADS is set. Interrupted
    (Ctrl-C, SIGTERM as an interrupt), torchrun is asked to stop its ranks (SIGTERM) and
    killed if it has not within `STOP_SECONDS`; its ranks die with it."""
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    log.info("launching: %s", " ".join(cmd))
    with subprocess.Popen(cmd, env=env) as agent:
        try:
            return agent.wait()
        except BaseException:
            agent.terminate()
            try:
                agent.wait(timeout=STOP_SECONDS)
            except BaseException:
                agent.kill()
            raise


def die_with_launcher(always: bool = True) -> None:
    """Linux: this process gets SIGKILL when the process that started it ends; it ends at once
    if that one has already gone (its parent is no longer the pid the launcher named). Then the
    processes it starts are told its pid. `always`: also without a launcher's pid (a rank
    under a torchrun the user started: it dies with that torchrun)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if sys.platform != "linux" or not (launcher or always):
        return
    if not _death_signal(signal.SIGKILL):
        return
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        sys.stderr.write(f"shardforge: the process that started {sys.argv[0]} has ended; exiting\n")
        os._exit(1)


def die_with_parent(parent: str | None, sig: int) -> None:
    """Linux: this process gets `sig` when its parent ends; it exits at once when its parent is
    no longer `parent` (a pid, when given: the parent ended before the request)."""
    if sys.platform != "linux":
        return
    _death_signal(sig)
    if parent and str(os.getppid()) != parent:
        sys.exit(1)


def _death_signal(sig: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, sig); False where the C library has no prctl or it fails."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def raise_rank_error(error_file: Path) -> None:
    """Raise the user error a rank left in `error_file`, with its exit code (if it left one)."""
    if not error_file.is_file():
        return
    code, message = error_file.read_text(encoding="utf-8").split("\n", 1)
    error = ShardforgeError(message)
    error.exit_code = int(code)
    raise error


def leave_rank_error(exc: ShardforgeError) -> bool:
    """On a rank: leave `exc` for the launcher in the file it named (the first rank to fail
    writes it). False when no launcher asked for it (the rank prints the error itself)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    with contextlib.suppress(FileExistsError), open(path, "x", encoding="utf-8") as f:
        f.write(f"{exc.exit_code}\n{exc}")
    return True


def run_agent(argv: list[str]) -> None:
    """`python -m shardforge.io.ranks [torchrun args]`: torchrun (`torch.distributed.run`),
    dying with the command that started it, its ranks told its pid."""
    die_with_launcher(always=False)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(argv)
    except SignalException as exc:  # stopped (its ranks too): the command reports it
        raise SystemExit(128 + int(exc.sigval)) from None


if __name__ == "__main__":
    run_agent(sys.argv[1:])
