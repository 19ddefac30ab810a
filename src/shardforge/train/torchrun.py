"""`python -m shardforge.train.torchrun [torchrun args]`: torchrun, as `shardforge train` runs it.

It is `python -m torch.distributed.run` except when a rank stopped on a user error: that rank
left the message in the file named by SHARDFORGE_RANK_ERROR_FILE for the launcher to print once,
so torchrun's ChildFailedError report (a traceback and a failure table that only repeat it) is
left out and the exit status is 1. Any other failure is reported by torchrun as usual. It dies
with the `shardforge train` that started it, and its ranks with it (`io.ranks.die_with_launcher`).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from shardforge.io.ranks import ERROR_FILE_ENV, die_with_launcher

# where torchrun logs a worker's failure ("failed (exitcode: 1) local_rank: 0 ...")
ELASTIC_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class _UnlessReported(logging.Filter):
    """Drop torchrun's log records once a rank has left its user error for the launcher."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.path.is_file()


def main(argv: list[str]) -> None:
    die_with_launcher(always=False)  # before torch's imports: seconds
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        for name in ELASTIC_LOGGERS:
            logging.getLogger(name).addFilter(_UnlessReported(Path(error_file)))
    try:
        run(parse_args(argv))
    except ChildFailedError:
        if error_file and Path(error_file).is_file():
            raise SystemExit(1) from None
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
