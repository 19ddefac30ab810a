"""The launcher's side of a job of ranks: a rank's user error goes through the file once; every
process of the job dies with the one that started it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardforge.errors import ConfigError, ShardforgeError
from shardforge.io import ranks


def test_the_first_ranks_error_reaches_the_launcher_with_its_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "rank-error"
    monkeypatch.delenv(ranks.ERROR_FILE_ENV, raising=False)
    assert not ranks.leave_rank_error(ShardforgeError("no launcher"))  # the rank prints it
    ranks.raise_rank_error(error_file)  # nothing left: nothing raised

    monkeypatch.setenv(ranks.ERROR_FILE_ENV, str(error_file))
    assert ranks.leave_rank_error(ConfigError("cfg.yml", ["sequence_len: must be > 0"]))
    assert ranks.leave_rank_error(ShardforgeError("a second rank"))  # the first one stays
    with pytest.raises(ShardforgeError) as info:
        ranks.raise_rank_error(error_file)
    assert "sequence_len: must be > 0" in str(info.value) and "second" not in str(info.value)
    assert info.value.exit_code == ConfigError("x", ["y"]).exit_code


@pytest.mark.slow
def test_run_ranks_returns_the_status_and_splits_openmp_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ranks.os, "cpu_count", lambda: 8)
    env: dict[str, str] = {}
    code = "import os, sys; sys.exit(int(os.environ['OMP_NUM_THREADS']))"
    assert ranks.run_ranks([sys.executable, "-c", code], env, 4) == 2
    env = {"OMP_NUM_THREADS": "3"}
    assert ranks.run_ranks([sys.executable, "-c", code], env, 4) == 3


# a process that asks to die with its launcher, then says what the kernel holds for it
DIES_WITH_LAUNCHER = r"""
import ctypes, os, signal
from shardforge.io.ranks import LAUNCHER_PID_ENV, die_with_launcher
die_with_launcher()
sig = ctypes.c_int(0)
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
print(sig.value == signal.SIGKILL, os.environ[LAUNCHER_PID_ENV] == str(os.getpid()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.slow
def test_a_rank_dies_with_its_launcher_and_not_after_it() -> None:
    """The kernel holds SIGKILL for the process when its parent ends, and the process names
    itself for those it starts; a parent other than the launcher named (it ended before the
    request: the process was adopted) ends the process at once."""
    env = {**os.environ, ranks.LAUNCHER_PID_ENV: str(os.getpid())}
    run = [sys.executable, "-c", DIES_WITH_LAUNCHER]
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.split()) == (0, ["True", "True"]), proc.stderr

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    env[ranks.LAUNCHER_PID_ENV] = str(pid_max + 1)  # not its parent: that one has gone
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and not proc.stdout, proc.stdout
    assert "has ended; exiting" in proc.stderr, proc.stderr


# torchrun's stand-in: on SIGTERM it notes that it was asked to stop its ranks, then ends
STOPS_ON_SIGTERM = r"""
import pathlib, signal, sys, time
def stop(signum, frame):
    pathlib.Path(sys.argv[1]).write_text("asked to stop")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".started").touch()
time.sleep(120)
"""


@pytest.mark.slow
def test_an_interrupted_launcher_asks_torchrun_to_stop_its_ranks(tmp_path: Path) -> None:
    """Ctrl-C (KeyboardInterrupt) while the launcher waits: torchrun gets SIGTERM (it stops its
    ranks) and the launcher waits for it, then the interrupt goes on."""
    import signal
    import time

    marker = tmp_path / "stopped"

    def ctrl_c_once_started(signum: int, frame: object) -> None:
        if not marker.with_name("stopped.started").exists():
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # look again
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, ctrl_c_once_started)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    begun = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ranks.run_ranks([sys.executable, "-c", STOPS_ON_SIGTERM, str(marker)], {}, 1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert marker.read_text() == "asked to stop"
    assert time.monotonic() - begun < 60
