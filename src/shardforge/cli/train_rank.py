"""One training rank, as `shardforge train` has torchrun start it:
`python -m shardforge.cli.train_rank CONFIG [overrides]` (the config was checked by the launcher)."""

from __future__ import annotations

import os
import sys

from shardforge.cli._common import run_guarded, setup_logging, split_debug
from shardforge.cli.main import exit_now
from shardforge.errors import ShardforgeError
from shardforge.io.ranks import die_with_launcher
from shardforge.startup import import_model_code, lazy_packages, relaxed_gc


def main(argv: list[str]) -> None:
    die_with_launcher()  # no rank outlives torchrun's agent, nor the agent `shardforge train`
    with relaxed_gc():  # the lighter start-up (`shardforge.startup`): no full collections
        lazy_packages()  # while torch and transformers import, and no package loaded unused
        from shardforge.train.launch import load_checked, report_rank_error

        import_model_code()
        from shardforge.train.loop import run_training

    args, debug = split_debug(argv)
    if not args:
        print(
            "usage: python -m shardforge.cli.train_rank CONFIG [--key value ...]", file=sys.stderr
        )
        raise SystemExit(2)
    setup_logging(quiet=os.environ.get("RANK", "0") != "0", timed=True)  # lines with times

    def train() -> None:
        try:
            run_training(load_checked(args[0], args[1:]), keep_group=True)
        except ShardforgeError as exc:
            report_rank_error(exc)
            raise

    run_guarded(train, debug)
    # Every rank finished together, its checkpoints and merges done: leave without gloo's
    # teardown and the interpreter's (either once aborted a rank of a complete run with
    # "terminate called without an active exception"), as a merge rank does.
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
