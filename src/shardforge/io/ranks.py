"""The launcher's side of a job of several ranks (torchrun), for training and the merge alike.

The launcher names a file in SHARDFORGE_RANK_ERROR_FILE; the first rank that stops on a user
error leaves its exit code and message there (`leave_rank_error`) and exits quietly, and the
launcher raises that error once (`raise_rank_error`) instead of every rank and torchrun
printing it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from pathlib import Path

from shardforge.errors import ShardforgeError

log = logging.getLogger("shardforge")

# set by the launcher for the ranks: where the first rank that fails on a user error writes it
ERROR_FILE_ENV = "SHARDFORGE_RANK_ERROR_FILE"


def run_ranks(cmd: list[str], env: dict[str, str], nproc: int) -> int:
    """Run the torchrun command `cmd` (`nproc` ranks on this machine); its exit status.
    OpenMP threads are split between the ranks unless OMP_NUM_THREADS is set."""
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    log.info("launching: %s", " ".join(cmd))
    return subprocess.call(cmd, env=env)


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
