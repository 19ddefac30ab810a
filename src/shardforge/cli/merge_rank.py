"""One rank of a distributed merge, as `merge-sharded-fsdp-weights --nproc_per_node N` has
torchrun start it: `python -m shardforge.cli.merge_rank REQUEST.json`."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from shardforge.cli._common import run_guarded, setup_logging, split_debug
from shardforge.cli.main import exit_now
from shardforge.errors import ShardforgeError
from shardforge.io.publish import sigterm_as_interrupt
from shardforge.io.ranks import die_with_launcher


def main(argv: list[str]) -> None:
    die_with_launcher()  # no rank outlives torchrun's agent, nor the agent the command
    args, debug = split_debug(argv)
    if len(args) != 1:
        print("usage: python -m shardforge.cli.merge_rank REQUEST.json", file=sys.stderr)
        raise SystemExit(2)
    setup_logging(quiet=os.environ.get("RANK", "0") != "0")

    def merge() -> None:
        from shardforge.startup import lazy_packages, relaxed_gc

        lazy_packages()
        with relaxed_gc():  # no full collections while torch and transformers import
            import torch.distributed as dist

            from shardforge.io.dist import finish_together
            from shardforge.merge.launch import DONE_FILE_ENV, ERROR_FILE_ENV, read_request
            from shardforge.merge.on_ranks import merge_on_ranks

        config, request = read_request(Path(args[0]))
        dist.init_process_group("gloo")
        finished = False
        try:
            merge_on_ranks(config, request)
            finish_together()
            done = os.environ.get(DONE_FILE_ENV)
            if done and dist.get_rank() == 0:  # published: the launcher reports success
                Path(done).touch()
            finished = True
        except ShardforgeError as exc:
            path = os.environ.get(ERROR_FILE_ENV)
            if path:  # the first rank to fail leaves the message for the launcher
                with contextlib.suppress(FileExistsError), open(path, "x", encoding="utf-8") as f:
                    f.write(f"{exc.exit_code}\n{exc}")
                raise SystemExit(exc.exit_code) from None
            raise
        finally:
            if not finished:
                dist.destroy_process_group()

    # SIGTERM (torchrun's agent sends it to stop the ranks) is an interrupt: rank 0 removes
    # its hidden directory and lets go of the output's lock on its way out
    with sigterm_as_interrupt():
        run_guarded(merge, debug)
    # Every rank finished together and the output is published: leave without gloo's
    # teardown, which once aborted a rank after a complete merge ("terminate called without
    # an active exception"), and without the interpreter's.
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
