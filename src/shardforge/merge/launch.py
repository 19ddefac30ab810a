"""Start a distributed merge: torchrun (`io.ranks.run_agent`: it and its ranks die with this
process) runs `python -m shardforge.cli.merge_rank REQUEST` on
every rank (gloo, CPU only), the request being the checked config and options in a JSON file.

Like `train`, one machine gets `--standalone`; several pass `--nnodes`, `--node_rank`,
`--rdzv_endpoint` (or `--master_addr`/`--master_port`) through. A rank that stops on a user
error leaves its message in a file; the launcher prints it once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError
from shardforge.io.ranks import ERROR_FILE_ENV, raise_rank_error, run_ranks
from shardforge.merge.request import MergeRequest

log = logging.getLogger("shardforge")

# rank 0 creates this file once every rank has finished and the output is published
DONE_FILE_ENV = "SHARDFORGE_MERGE_DONE_FILE"


def torchrun_command(request: MergeRequest, request_file: Path) -> list[str]:
    cmd = [sys.executable, "-m", "shardforge.io.ranks"]  # torchrun, dying with this process
    cmd += ["--nproc_per_node", str(request.nproc_per_node or 1)]
    passthrough = {
        "--nnodes": request.nnodes,
        "--node_rank": request.node_rank,
        "--rdzv_endpoint": request.rdzv_endpoint,
        "--rdzv_backend": request.rdzv_backend,
        "--rdzv_id": request.rdzv_id,
        "--master_addr": request.master_addr,
        "--master_port": request.master_port,
        "--max_restarts": request.max_restarts,
    }
    alone = request.rdzv_endpoint is None and request.master_addr is None
    if alone and request.nnodes in (None, "1"):
        cmd.append("--standalone")
    for flag, value in passthrough.items():
        if value is not None:
            cmd += [flag, str(value)]
    return [*cmd, "-m", "shardforge.cli.merge_rank", str(request_file)]


def write_request(config: ShardforgeConfig, request: MergeRequest, path: Path) -> None:
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(request).items()}
    data = {"config": config.model_dump(mode="json"), "request": fields}
    path.write_text(json.dumps(data), encoding="utf-8")


def read_request(path: Path) -> tuple[ShardforgeConfig, MergeRequest]:
    data = json.loads(path.read_text(encoding="utf-8"))
    fields = data["request"]
    fields["average_steps"] = tuple(fields.get("average_steps") or ())
    return ShardforgeConfig.model_validate(data["config"]), MergeRequest(**fields)


def launch_merge(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """Run the merge on the requested ranks; the output path, or the ranks' one error."""
    assert request.output_path is not None  # the request requires it for --format hf
    with tempfile.TemporaryDirectory(prefix="shardforge-merge-") as tmp:
        request_file = Path(tmp) / "request.json"
        write_request(config, request, request_file)
        error_file = Path(tmp) / "rank-error"
        done_file = Path(tmp) / "published"
        env = {**os.environ, ERROR_FILE_ENV: str(error_file), DONE_FILE_ENV: str(done_file)}
        cmd = torchrun_command(request, request_file)
        status = run_ranks(cmd, env, request.nproc_per_node or 1)
        if status != 0 and done_file.is_file():
            # every rank finished and rank 0 published; a rank died in torch's teardown after
            log.warning(
                "warning: a merge rank exited with an error after the output was published "
                "(torchrun exit status %d); the output is complete",
                status,
            )
            status = 0
        if status != 0:
            raise_rank_error(error_file)
    if status != 0:
        raise MergeError(
            f"the distributed merge failed (torchrun exit status {status}); nothing was "
            f"published at {request.output_path}; see the log above"
        )
    return request.output_path
