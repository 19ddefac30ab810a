"""Start training: check the config, then run the ranks (torchrun, or one rank in-process).

Outside torchrun, `train` re-executes itself as `python -m torch.distributed.run ... -m
shardforge.cli.train_rank CONFIG [overrides]`; under torchrun (LOCAL_RANK / TORCHELASTIC_RUN_ID set) it
runs the rank it was started as.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardforge.config import load_cfg, parse_override_args
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.io.ranks import (
    ERROR_FILE_ENV,
    die_with_launcher,
    leave_rank_error,
    raise_rank_error,
    run_ranks,
)
from shardforge.train.preflight import preflight
from shardforge.train.runtime import local_world_size, under_torchrun

log = logging.getLogger("shardforge")

Launcher = Literal["torchrun", "python"]
CPU_RANKS = 2
# set by the launcher for the ranks it starts: the config was checked moments ago
PREFLIGHT_DONE_ENV = "SHARDFORGE_PREFLIGHT_DONE"


def report_rank_error(exc: ShardforgeError) -> None:
    """On a rank started by `do_train`: leave the error for the launcher, which prints it once,
    and exit quietly with its status. (The first rank to fail writes the file; elsewhere this
    returns and the rank prints the error itself.)"""
    if leave_rank_error(exc):
        raise SystemExit(exc.exit_code)


@contextlib.contextmanager
def _quiet(enabled: bool) -> Iterator[None]:
    """Hold back shardforge's notices and warnings (not errors) while `enabled`."""
    logger = logging.getLogger("shardforge")
    level = logger.level
    if enabled:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun options passed through for one or many machines."""

    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None


def default_nproc() -> int:
    """One rank per GPU, or 2 CPU ranks (gloo) without a GPU."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_RANKS


def load_checked(
    config: str | Path, override_args: list[str], world: tuple[int, int] | None = None
) -> ShardforgeConfig:
    """The validated config with every pre-launch check passed (raises ConfigError otherwise).

    `world` is (world size, ranks per machine) when known (under torchrun: from its
    environment). Ranks started by `do_train`'s torchrun skip the checks the launcher has just
    made and keep the config's notices to themselves (the launcher printed them); so do all ranks
    but rank 0 under a plain torchrun.
    """
    launched = os.environ.get(PREFLIGHT_DONE_ENV) == "1"
    with _quiet(launched or os.environ.get("RANK", "0") != "0"):
        cfg = load_cfg(config, command="train", **parse_override_args(override_args))
        if not launched:
            if world is None and under_torchrun():
                world = (int(os.environ["WORLD_SIZE"]), local_world_size() or 1)
            preflight(cfg, str(config), world)
    return cfg


def torchrun_command(config: str, override_args: list[str], opts: LaunchOptions) -> list[str]:
    nproc = opts.nproc_per_node or default_nproc()
    cmd = [sys.executable, "-m", "shardforge.train.torchrun", "--nproc_per_node", str(nproc)]
    passthrough = {
        "--nnodes": opts.nnodes,
        "--node_rank": opts.node_rank,
        "--rdzv_endpoint": opts.rdzv_endpoint,
        "--rdzv_backend": opts.rdzv_backend,
        "--rdzv_id": opts.rdzv_id,
        "--master_addr": opts.master_addr,
        "--master_port": opts.master_port,
        "--max_restarts": opts.max_restarts,
    }
    if opts.rdzv_endpoint is None and opts.master_addr is None and opts.nnodes in (None, "1"):
        cmd.append("--standalone")
    for flag, value in passthrough.items():
        if value is not None:
            cmd += [flag, str(value)]
    return [*cmd, "-m", "shardforge.cli.train_rank", str(config), *override_args]


def _launch_world(launcher: Launcher, nproc: int, nnodes: str | None) -> tuple[int, int] | None:
    """(world size, ranks per machine) of the job `do_train` starts, when known up front."""
    if under_torchrun():
        return None  # load_checked reads torchrun's environment
    if launcher == "python":
        return (1, 1)
    if nnodes is None or nnodes.isdigit():
        return (nproc * int(nnodes or 1), nproc)
    return None  # an elastic MIN:MAX: the ranks check their mesh when they start


def do_train(
    config: str | Path,
    override_args: list[str] | None = None,
    launcher: Launcher = "torchrun",
    opts: LaunchOptions | None = None,
    debug: bool = False,
) -> int:
    """Check the config, then train; return the exit status of the ranks (0 on success).

    `debug` is passed on to the ranks (tracebacks instead of one-line errors).
    """
    args = list(override_args or [])
    opts = opts or LaunchOptions()
    nproc = opts.nproc_per_node or default_nproc()
    cfg = load_checked(config, args, _launch_world(launcher, nproc, opts.nnodes))
    if under_torchrun() or launcher == "python":
        from shardforge.train.loop import run_training

        if under_torchrun():  # a rank of the user's torchrun: it dies with that torchrun
            die_with_launcher()

        run_training(cfg)
        return 0
    cmd = torchrun_command(str(config), [*args, "--debug"] if debug else args, opts)
    with tempfile.TemporaryDirectory(prefix="shardforge-") as tmp:
        error_file = Path(tmp) / "rank-error"
        env = {**os.environ, PREFLIGHT_DONE_ENV: "1"}
        if not debug:  # with --debug every rank shows its traceback, and torchrun its report
            env[ERROR_FILE_ENV] = str(error_file)
        status = run_ranks(cmd, env, nproc)
        if status != 0:
            raise_rank_error(error_file)
    if status != 0:
        raise ShardforgeError(f"training failed (torchrun exit status {status}); see the log above")
    return 0
