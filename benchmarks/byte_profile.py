"""Where one merge's time goes, stage by stage, from counters (no sampling profiler needed).

Runs `shardforge merge-sharded-fsdp-weights CFG --checkpoint CKPT --output_path OUT` in this
process, as the console command runs it (the head start before `import torch` included), with
timing wrappers around the byte path's stages, and prints one JSON report when the merge exits:

- per stage, summed over threads: calls, bytes, wall seconds and the thread CPU seconds spent
  in it (`time.thread_time`): wall well above CPU is waiting (on the disk, or for a turn);
  the stages: `map` (a source block mapped), `fault` (its pages touched: on cold data, the
  reads a mapping makes, page by page), `hash` (`FileHash.feed_in_turn`: the wait for the
  block's turn and the SHA-256), `kernel_copy` (`copy_file_range`), `fsync`, `prefetch`
  (`posix_fadvise(WILLNEED)`), `read_ahead` (the byte path's own read-ahead, where it has one);
- the main thread's phases as offsets from the start: the early copy planned and started,
  torch and transformers imported, `prepare` (the architecture, the checks, the plan), the
  early copy accepted, the merge written;
- the process's I/O (`/proc/self/io`: bytes read from the disk, bytes written), its page faults
  (major: a read from the disk) and CPU (user, kernel, all threads).

`BYTE_PROFILE_SPLIT_FAULTS=0` leaves `io.copy._hash_and_copy` as it is (the faults then count in
the hash stage): the touching of every page costs a little CPU of its own.

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
import mmap
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


def _touch(block: memoryview) -> None:
    """Fault every page of a mapped block in (one byte per page read)."""
    for at in range(0, len(block), mmap.PAGESIZE):
        block[at]


def install() -> None:
    import shardforge.io.copy as copy
    import shardforge.io.digest as digest
    import shardforge.io.readahead as readahead
    from shardforge.io.copy import CheckpointError

    real_feed_in_turn = digest.FileHash.feed_in_turn
    digest.FileHash.feed_in_turn = timed(  # type: ignore[method-assign]
        "hash", real_feed_in_turn, lambda self, off, data: len(data)
    )
    copy._kernel_copy = timed("kernel_copy", copy._kernel_copy, lambda s, d, so, do, n: n)
    readahead.prefetch = timed("prefetch", readahead.prefetch)
    if hasattr(readahead, "ReadAhead"):
        readahead.ReadAhead.started = timed(  # type: ignore[method-assign]
            "read_ahead", readahead.ReadAhead.started
        )
    os.fsync = timed("fsync", os.fsync)

    if os.environ.get("BYTE_PROFILE_SPLIT_FAULTS", "1") == "1":
        real = copy._hash_and_copy

        def hash_and_copy(
            src: int, dst: int, src_off: int, dst_off: int, count: int, h: Any, in_turn: bool
        ) -> None:
            """`io.copy._hash_and_copy` with the mapping and its faults timed apart from the
            hash (the same blocks, in the same order)."""
            if copy.remote_of(src) is not None:
                return real(src, dst, src_off, dst_off, count, h, in_turn)
            size = os.fstat(src).st_size
            if src_off + count > size:
                raise CheckpointError("short data file")
            while count > 0:
                n = min(count, copy.HASH_BLOCK)
                start = src_off - src_off % mmap.ALLOCATIONGRANULARITY
                w, c = time.perf_counter(), time.thread_time()
                mapped = mmap.mmap(
                    src, n + src_off - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start
                )
                _add("map", n, time.perf_counter() - w, time.thread_time() - c)
                with mapped, memoryview(mapped)[src_off - start :] as block:
                    w, c = time.perf_counter(), time.thread_time()
                    _touch(block)
                    _add("fault", n, time.perf_counter() - w, time.thread_time() - c)
                    (h.feed_in_turn if in_turn else h.feed)(dst_off, block)
                copy._kernel_copy(src, dst, src_off, dst_off, n)
                src_off, dst_off, count = src_off + n, dst_off + n, count - n
            return None

        copy._hash_and_copy = hash_and_copy

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


def evict(folder: Path) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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
        evict(Path(args.checkpoint))
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
