"""`python -m shardforge ...` started from a warm process: a child with torch, transformers and
shardforge's merge already imported, for the tests that stop, signal or kill a merge (the
process is what they act on; its interpreter start-up, 5-6 CPU-s of imports each time, is not
what they test). The real start-up and exit contract stays tested by the tests that run
`python -m shardforge` itself (tests/cli).

    proc = warm.popen(cmd, env=env)      # cmd: [sys.executable, "-m", "shardforge", ...]
    gate.wait(proc); proc.send_signal(signal.SIGINT); _, stderr = proc.communicate(timeout=60)

`Zygote` (one per test process, shared by the modules that ask: `yield from
zygote_fixture(request)` in a module fixture) is a Python process started once that imports
the merge's modules and then forks one child per command: the child takes the
command's environment, working directory and stdin/stdout/stderr, installs the test's gate
(`helpers.gate`) as `sitecustomize` would at start-up, and runs `shardforge`'s `__main__` as
`-m` does. `popen` returns a `subprocess.Popen`-like handle (pid, poll, wait, communicate,
send_signal, kill, returncode; the exit status as Popen gives it, -N for signal N). A child
dies with the zygote, and the zygote with the test process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from helpers.gate import SITE

# what the zygote imports before it forks (what every merge imports anyway)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "s3fs",
    "shardforge.cli.main",
    "shardforge.cli.merge_sharded_fsdp_weights",
    "shardforge.merge.api",
    "shardforge.merge.run",
    "shardforge.sinks.object_store",
    "shardforge.sinks.uploads",
)

_SERVER = r"""
import ctypes, json, os, selectors, signal, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1
libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
for name in json.loads(sys.argv[2]):
    __import__(name)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sys.argv[1])
server.listen(16)
print("ready", flush=True)
children = {}  # pid -> connection

def child(conn, request, fds):
    server.close()
    for c in children.values():
        c.close()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.close()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    import tempfile
    tempfile.tempdir = None
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    if os.environ.get("SHARDFORGE_TEST_GATE"):  # what sitecustomize does at start-up
        import importlib.util
        spec = importlib.util.spec_from_file_location("sitecustomize", request["site"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    import runpy
    sys.argv = ["-m", *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))

selector = selectors.DefaultSelector()
selector.register(server, selectors.EVENT_READ)
while True:
    for _ in selector.select(timeout=0.05):
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            finally:
                conn.close()
"""


class WarmProcess:
    """The handle of one command forked by the zygote (the parts of `subprocess.Popen` the
    tests use)."""

    def __init__(self, conn: socket.socket, stderr: int | None, args: list[str]) -> None:
        self.args = args
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._message(block=True)["pid"])
        self._stderr = stderr
        self.returncode: int | None = None

    def _message(self, block: bool) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            self._conn.setblocking(block)
            try:
                data = self._conn.recv(4096)
            except BlockingIOError:
                return None
            if not data:
                raise RuntimeError("the zygote went away")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._message(block=False)
            if message is not None:
                self.returncode = int(message["status"])
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[None, str | None]:
        """Its stderr (when a pipe) once it has ended, and its exit status set."""
        deadline = None if timeout is None else time.monotonic() + timeout
        err = None
        if self._stderr is not None:
            chunks = []
            while True:  # until EOF: the child has ended
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([self._stderr], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                chunk = os.read(self._stderr, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(self._stderr)
            self._stderr = None
            err = b"".join(chunks).decode(errors="replace")
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 5)
        return None, err

    def __del__(self) -> None:
        if getattr(self, "_stderr", None) is not None:
            os.close(self._stderr)  # type: ignore[arg-type]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = str(folder / "zygote.sock")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, self.path, json.dumps(PRELOAD)],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip() == "ready", f"the zygote did not start: {line!r}"

    def popen(
        self, cmd: list[str], env: Mapping[str, str] | None = None, stderr: Any = None
    ) -> WarmProcess:
        """Start `cmd` ([python, "-m", module, *args]) forked from the zygote; stderr is a
        pipe when `stderr` is subprocess.PIPE (else this process's)."""
        assert cmd[0] == sys.executable and cmd[1] == "-m", cmd
        read = None
        if stderr == subprocess.PIPE:
            read, write = os.pipe()
        else:
            write = os.dup(2)
        fds = [os.open(os.devnull, os.O_RDONLY), os.dup(1), write]
        request = {
            "module": cmd[2],
            "args": cmd[3:],
            "env": dict(os.environ if env is None else env),
            "cwd": os.getcwd(),
            "site": str(SITE / "sitecustomize.py"),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        try:
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
        finally:
            for fd in fds:
                os.close(fd)
        return WarmProcess(conn, read, cmd)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=60)
        if self.process.stdout is not None:
            self.process.stdout.close()
        Path(self.path).unlink(missing_ok=True)


_SHARED: list[Zygote] = []  # this test process's zygote, once started


def zygote_fixture(request: pytest.FixtureRequest) -> Iterator[Zygote]:
    """The body of a module fixture: this test process's zygote, started by the first module
    that asks and shared by the others (an xdist worker runs several), stopped when the
    session ends."""
    from helpers import children

    if _SHARED and _SHARED[0].process.poll() is None:
        children.started("helpers.zygote: shared, started by another module's fixture")
    else:
        factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
        warm = Zygote(factory.mktemp("zygote"))
        _SHARED[:] = [warm]
        request.config.add_cleanup(warm.stop)
    yield _SHARED[0]


def killed_at(warm: Zygote, gate: Any, cmd: list[str], env: Mapping[str, str]) -> None:
    """`helpers.s3.killed_at` with the command forked by `warm`: run it until it waits at
    `gate` (a `helpers.gate.Gate`), then SIGKILL it."""
    from helpers.s3 import kill_at_gate

    proc = warm.popen(cmd, env=env, stderr=subprocess.PIPE)
    kill_at_gate(gate, proc)
    proc.communicate(timeout=60)
