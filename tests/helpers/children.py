"""Notice every child process a test starts (tests/conftest.py fails such a test unless it is
marked `slow`).

`install()` notices the ways a process is started: `subprocess` (and with it `torchrun`),
`multiprocessing` (spawn, fork, forkserver; `torch.multiprocessing` and the gloo ranks of
`helpers.dist.run_on_ranks`), `os.fork`, `os.posix_spawn[p]`, `os.spawn*`, `os.system`. While
`watching()` is active each start is recorded, as a short description of what was started
and from where.

A helper that returns what child processes made earlier (a cache shared between tests or xdist
workers, like `test_inspection.build_checkpoints`) calls `started(...)` on a cache hit too, so
that whether a test counts as starting processes does not depend on which test ran first.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]

_records: list[list[str]] = []  # one list per active `watching()`, innermost last


def _where() -> str:
    """Where in the tests the start came from (file:line): the innermost frame outside
    tests/helpers, else the innermost one inside."""
    frames = [f for f in traceback.extract_stack() if Path(f.filename).is_relative_to(TESTS)]
    frames = [f for f in frames if Path(f.filename) != Path(__file__)]
    outside = [f for f in frames if not Path(f.filename).is_relative_to(TESTS / "helpers")]
    for frame in reversed(outside or frames):
        return f"{Path(frame.filename).relative_to(TESTS)}:{frame.lineno}"
    return "?"


def started(what: str) -> None:
    """Record that a child process was started (or that a cached result of one was used)."""
    if _records:
        _records[-1].append(f"{what} (from {_where()})")


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """Collect the starts in the block (nested blocks each see their own)."""
    records: list[str] = []
    _records.append(records)
    try:
        yield records
    finally:
        del _records[next(i for i, r in enumerate(_records) if r is records)]
        if _records:
            _records[-1].extend(records)


def _command(args: Any) -> str:
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args)
    try:
        return " ".join(os.fsdecode(a) for a in args)
    except TypeError:
        return repr(args)


# audit events of the starts of a child process -> what to say of their arguments
_EVENTS: dict[str, Callable[..., str]] = {
    "subprocess.Popen": lambda executable, args, *_: f"subprocess {_command(args)}",
    "os.fork": lambda: "os.fork",
    "os.forkpty": lambda: "os.forkpty",
    "os.system": lambda command: f"os.system {os.fsdecode(command)}",
    "os.posix_spawn": lambda path, argv, *_: f"os.posix_spawn {_command(argv)}",
    "os.spawn": lambda mode, path, args, *_: f"os.spawn {_command(args)}",
}
_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _records and event in _EVENTS:
        started(_EVENTS[event](*args)[:200])


def install() -> None:
    """Notice the process starters (once; a start outside `watching()` is not recorded).

    `subprocess` and `os` raise audit events (hooked here, so that `os.system` & co. stay
    the very same objects: tests pickle them in hostile payloads); multiprocessing's spawn
    raises none, so `BaseProcess.start` is wrapped."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.addaudithook(_audit)
    original = multiprocessing.process.BaseProcess.start

    def start(self: multiprocessing.process.BaseProcess) -> None:
        if _records:
            started(f"multiprocessing {self.name} ({getattr(self, '_start_method', '')})")
        original(self)

    multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
