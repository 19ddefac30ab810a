"""Start training: check the config, then run the ranks (torchrun, or one rank in-process).

Outside torchrun, `train` re-executes itself as `python -m torch.distributed.run ... -m
shardforge.train CONFIG [overrides]`; under torchrun (LOCAL_RANK / TORCHELASTIC_RUN_ID set) it
runs the rank it was started as.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardforge.config import load_cfg, parse_override_args
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.train.preflight import preflight
from shardforge.train.runtime import under_torchrun

log = logging.getLogger("shardforge")

Launcher = Literal["torchrun", "python"]
CPU_RANKS = 2
# set by the launcher for the ranks it starts: the config was checked moments ago
PREFLIGHT_DONE_ENV = "SHARDFORGE_PREFLIGHT_DONE"
# set by the launcher: where rank 0 writes the user error that stopped it
ERROR_FILE_ENV = "SHARDFORGE_RANK_ERROR_FILE"


def report_rank_error(exc: ShardforgeError) -> None:
    """On rank 0 started by `do_train`: leave the error for the launcher to print last."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        Path(path).write_text(f"{exc.exit_code}\n{exc}", encoding="utf-8")


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


def load_checked(config: str | Path, override_args: list[str]) -> ShardforgeConfig:
    """The validated config with every pre-launch check passed (raises ConfigError otherwise).

    Ranks started by `do_train`'s torchrun skip the checks the launcher has just made.
    """
    cfg = load_cfg(config, **parse_override_args(override_args)).to_model()
    if os.environ.get(PREFLIGHT_DONE_ENV) != "1":
        preflight(cfg, str(config))
    return cfg


def torchrun_command(config: str, override_args: list[str], opts: LaunchOptions) -> list[str]:
    nproc = opts.nproc_per_node or default_nproc()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
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
    return [*cmd, "-m", "shardforge.train", str(config), *override_args]


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
    cfg = load_checked(config, args)
    if under_torchrun() or launcher == "python":
        from shardforge.train.loop import run_training

        run_training(cfg)
        return 0
    cmd = torchrun_command(
        str(config), [*args, "--debug"] if debug else args, opts or LaunchOptions()
    )
    nproc = (opts or LaunchOptions()).nproc_per_node or default_nproc()
    with tempfile.TemporaryDirectory(prefix="shardforge-") as tmp:
        error_file = Path(tmp) / "rank-error"
        env = {**os.environ, PREFLIGHT_DONE_ENV: "1", ERROR_FILE_ENV: str(error_file)}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        log.info("launching: %s", " ".join(cmd))
        status = subprocess.call(cmd, env=env)
        if status != 0 and error_file.is_file():
            code, message = error_file.read_text(encoding="utf-8").split("\n", 1)
            error = ShardforgeError(message)
            error.exit_code = int(code)
            raise error
    if status != 0:
        raise ShardforgeError(f"training failed (torchrun exit status {status}); see the log above")
    return 0
