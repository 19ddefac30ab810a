r"""Stop a child process at a chosen call, so that a test acts (a signal, `kill -9`) at a moment
the child itself reports, instead of racing its speed.

    gate = Gate(tmp_path / "gate", "os:pwrite", r"/\.out\.tmp-[^/]+/model.*\.safetensors$")
    proc = subprocess.Popen(cmd, env=gate.env())
    gate.wait(proc)            # the child wrote (after=True) into that file and now waits
    proc.send_signal(signal.SIGTERM)

The child's first call of `target` ("module:attribute", e.g. "os:pwrite",
"pathlib:Path.rename", "threading:Thread.start") whose first argument matches `match` (a
regular expression searched in the path of that argument: a file descriptor's file, a path,
else its str()), on a thread whose name matches `thread` (default: the main thread), pauses
after the call (or before it, `after=False`) until `open()` (`nth`: at its nth matching call instead). Every Python process started
with `env()` (torchrun's ranks too) carries the gate and pauses once, at its own first
matching call. A pause sleeps in short steps: on the main thread a signal's handler
(KeyboardInterrupt) runs at once. A process left paused by a failed test goes on by itself
after 10 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

SITE = Path(__file__).parent / "gate_site"
ENV = "SHARDFORGE_TEST_GATE"


class Gate:
    def __init__(
        self,
        directory: Path,
        target: str,
        match: str,
        *,
        after: bool = True,
        thread: str = "^MainThread$",
        nth: int = 1,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.spec = {
            "dir": str(directory),
            "target": target,
            "match": match,
            "when": "after" if after else "before",
            "thread": thread,
            "nth": nth,
        }

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a child that carries the gate (default: this process's)."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
        env[ENV] = json.dumps(self.spec)
        return env

    def reached(self) -> list[int]:
        """The pids of the processes waiting at the gate."""
        return sorted(int(p.name.split("-")[1]) for p in self.directory.glob("reached-*[0-9]"))

    def wait(
        self, proc: subprocess.Popen[str] | subprocess.Popen[bytes], count: int = 1
    ) -> list[int]:
        """Wait until `count` processes wait at the gate (their pids); fail if `proc` ends
        first. No time limit of its own: the test's timeout bounds a hang."""
        while len(pids := self.reached()) < count:
            code = proc.poll()
            assert code is None, f"the process ended (exit status {code}) before the gate"
            time.sleep(0.01)
        return pids

    def open(self) -> None:
        """Let the waiting processes go on."""
        (self.directory / "open").touch()
