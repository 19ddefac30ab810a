"""Processes a test started, seen from outside: which of them still run."""

from __future__ import annotations

import contextlib
import time

import psutil


def still_running(pids: list[int], seconds: float) -> list[int]:
    """The pids of `pids` that still run after up to `seconds` (a zombie has ended: it waits
    only to be reaped, by whichever process adopted it)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
