"""Where one merge's time goes, stage by stage, from counters (no sampling profiler needed).

Runs `shardforge merge-sharded-fsdp-weights CFG --checkpoint CKPT --output_path OUT` in this
process, as the console command runs it (the head start before `import torch` included), with
timing wrappers around the byte path's stages, and prints one JSON report when the merge exits:

- per stage, summed over threads: calls, bytes, wall seconds and the thread CPU seconds spent
  in it (`time.thread_time`): wall well above CPU is waiting (on the disk, or for a turn);
  the stages: `hash` (`FileHash._drive`: the manifest's hash reading the written bytes back,
  on its own thread, and the remainder a finished file waits for), `kernel_copy`
  (`copy_range`: `copy_file_range`), `fsync`, `prefetch` (`posix_fadvise(WILLNEED)`),
  `read_ahead` (the byte path's own read-ahead, where it has one);
- the main thread's phases as offsets from the start: the early copy planned and started,
  torch and transformers imported, `prepare` (the architecture, the checks, the plan), the
  early copy accepted, the merge written;
- the process's I/O (`/proc/self/io`: bytes read from the disk, bytes written), its page faults
  (major: a read from the disk) and CPU (user, kernel, all threads).

The checkpoint's files are evicted from the page cache first with `--cold` (fsync and
`posix_fadvise(DONTNEED)`, as `merge_bench.py --cache cold`). On a shared, loaded machine the
wall seconds move with the load; the CPU seconds and the structure (which stage waits) less.

    python benchmarks/byte_profile.py .bench/llama-1GB-float32-1r/bench.yml \\
        .bench/llama-1GB-float32-1r/out/checkpoint-1/pytorch_model_fsdp_0 /tmp/out --cold
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import resource
import shutil
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import evict  # fsync, then posix_fadvise DONTNEED

T0 = time.perf_counter()
STAGES: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])  # calls, bytes, wall, cpu
PHASES: dict[str, float] = {}
_LOCK = threading.Lock()


def _add(stage: str, nbytes: int, wall: float, cpu: float) -> None:
    with _LOCK:
        row = STAGES[stage]
        row[0] += 1
        row[1] += nbytes
        row[2] += wall
        row[3] += cpu


def timed(stage: str, fn: Callable[..., Any], nbytes: Callable[..., int] | None = None) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            n = nbytes(*args, **kwargs) if nbytes is not None else 0
            _add(stage, n, time.perf_counter() - w, time.thread_time() - c)

    return wrapper


def phase(name: str, fn: Callable[..., Any]) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        PHASES.setdefault(f"{name} start", time.perf_counter() - T0)
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[f"{name} end"] = time.perf_counter() - T0

    return wrapper


def install() -> None:
    import shardforge.io.copy as copy
    import shardforge.io.digest as digest
    import shardforge.io.readahead as readahead

    digest.FileHash._drive = timed(  # type: ignore[method-assign]
        "hash", digest.FileHash._drive, lambda self, upto: 0
    )
    # (modules that imported copy_range by name before this ran keep the untimed one)
    copy.copy_range = timed("kernel_copy", copy.copy_range, lambda s, d, so, do, n: n)
    readahead.prefetch = timed("prefetch", readahead.prefetch)
    if hasattr(readahead, "ReadAhead"):
        readahead.ReadAhead.started = timed(  # type: ignore[method-assign]
            "read_ahead", readahead.ReadAhead.started
        )
    os.fsync = timed("fsync", os.fsync)

    from shardforge.merge import overlap

    overlap.EarlyCopy.start = phase("early copy started", overlap.EarlyCopy.start)
    overlap.EarlyCopy._copy = phase("early copy", overlap.EarlyCopy._copy)


def watch_imports() -> None:
    """Timestamps of torch and transformers appearing in sys.modules (polled every 5 ms)."""

    def run() -> None:
        wanted = ["torch", "transformers"]
        while wanted:
            for name in list(wanted):
                if name in sys.modules:
                    PHASES[f"import {name} begun"] = time.perf_counter() - T0
                    wanted.remove(name)
            time.sleep(0.005)

    threading.Thread(target=run, daemon=True).start()


def proc_io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, value = line.split(":")
        out[key.strip()] = int(value)
    return out


def later_phases() -> None:
    """`prepare` and the sink's write, timed once the merge's modules are imported (they
    import torch: wrapped from a hook on the early copy's acceptance)."""
    from shardforge.merge import overlap

    real_accept = overlap.EarlyCopy.accept
    overlap.EarlyCopy.accept = phase("early copy accepted", real_accept)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--report", default="", help="also write the report to this file")
    args, extra = parser.parse_known_args()
    shutil.rmtree(args.output, ignore_errors=True)
    if args.cold:
        evict([p for p in sorted(Path(args.checkpoint).rglob("*")) if p.is_file()])
    io0, ru0 = proc_io(), resource.getrusage(resource.RUSAGE_SELF)
    global T0
    T0 = time.perf_counter()
    install()
    later_phases()
    watch_imports()

    def report() -> None:
        io1, ru1 = proc_io(), resource.getrusage(resource.RUSAGE_SELF)
        data = {
            "wall_s": time.perf_counter() - T0,
            "user_s": ru1.ru_utime - ru0.ru_utime,
            "kernel_s": ru1.ru_stime - ru0.ru_stime,
            "major_faults": ru1.ru_majflt - ru0.ru_majflt,
            "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
            "disk_read_MB": (io1["read_bytes"] - io0["read_bytes"]) / 1e6,
            "disk_write_MB": (io1["write_bytes"] - io0["write_bytes"]) / 1e6,
            "peak_rss_MB": ru1.ru_maxrss / 1e3,
            "cores": os.cpu_count(),
            "load_1min": os.getloadavg()[0],
            "stages": {
                k: {"calls": v[0], "MB": v[1] / 1e6, "wall_s": v[2], "cpu_s": v[3]}
                for k, v in sorted(STAGES.items())
            },
            "phases_s": dict(sorted(PHASES.items(), key=lambda kv: kv[1])),
        }
        text = json.dumps(data, indent=2)
        print(text, file=sys.stderr)
        if args.report:
            Path(args.report).write_text(text)

    atexit.register(report)
    sys.argv = [
        "shardforge",
        "merge-sharded-fsdp-weights",
        args.config,
        "--checkpoint",
        args.checkpoint,
        "--output_path",
        args.output,
        "--quiet",
        "--no-save-tokenizer",
        *extra,
    ]
    from shardforge.cli.main import main as cli

    cli()


if __name__ == "__main__":
    main()
