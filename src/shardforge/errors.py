"""User-facing errors. The CLI prints them as one line (no traceback unless --debug)."""

from __future__ import annotations


class ShardforgeError(ValueError):
    """Bad input from the user: a config, a path or a checkpoint. Printed without a traceback."""

    exit_code = 1


class ConfigError(ShardforgeError):
    """The YAML config or a command-line override is invalid. Exit code 2."""

    exit_code = 2

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1:
            msg = f"{source}: {problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            msg = f"{source}: {len(problems)} problems:\n{lines}"
        super().__init__(msg)


class CheckpointError(ShardforgeError):
    """A checkpoint cannot be found, read or trusted."""


class MergeError(ShardforgeError):
    """The merge cannot proceed (architecture mismatch, output exists, no disk space, ...)."""
