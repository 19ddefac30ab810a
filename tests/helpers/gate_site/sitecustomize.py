"""Loaded at start-up by every Python process whose PYTHONPATH starts with this folder (see
`helpers.gate`): when `SHARDFORGE_TEST_GATE` is set, one function is wrapped so that the
process stops at the first matching call until the test opens the gate.

Self-contained on purpose (standard library only): it runs before anything else is imported.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
import time
from typing import Any

_SPEC = os.environ.get("SHARDFORGE_TEST_GATE")
# a process left waiting by a failed test goes on by itself after this long
MAX_PAUSE_S = 600


def _path_of(value: Any) -> str:
    """What `match` is searched in: the path of a file descriptor or a path, else str()."""
    if isinstance(value, int):
        try:
            return os.readlink(f"/proc/self/fd/{value}")
        except OSError:
            return ""
    if isinstance(value, str | bytes | os.PathLike):
        return os.fsdecode(os.fspath(value))
    return str(value)


def _install(spec: dict[str, Any]) -> None:
    folder = spec["dir"]
    module_name, _, attr = spec["target"].partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = attr.split(".")
    for part in parents:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    pattern = re.compile(spec["match"])
    after, thread = spec["when"] == "after", re.compile(spec["thread"])
    nth = int(spec.get("nth", 1))
    lock = threading.Lock()
    fired = []
    seen = []

    def pause() -> None:
        reached = os.path.join(folder, f"reached-{os.getpid()}")
        with open(reached + ".tmp", "w") as f:
            f.write(threading.current_thread().name)
        os.rename(reached + ".tmp", reached)
        deadline = time.monotonic() + MAX_PAUSE_S
        while not os.path.exists(os.path.join(folder, "open")) and time.monotonic() < deadline:
            time.sleep(0.01)  # a signal handler runs here (main thread) and may raise

    def gated(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs) if after else None
        name = threading.current_thread().name
        if not fired and args and thread.search(name) and pattern.search(_path_of(args[0])):
            with lock:
                seen.append(True)
                first = not fired and len(seen) >= nth
                if first:
                    fired.append(True)
            if first:
                pause()
        return result if after else original(*args, **kwargs)

    setattr(owner, name, gated)


if _SPEC:
    _install(json.loads(_SPEC))
