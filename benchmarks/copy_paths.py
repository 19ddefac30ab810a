"""How one file's bytes can reach another, cold: CPU and wall of each kernel path (issue 36).

The merge copies a checkpoint's tensors into the output with `copy_file_range` (the kernel
splices the source's page cache into the output's: a `memcpy` per byte, in kernel time). On a
2-core machine the cold 8 GB merge is CPU-bound there (benchmarks/README, "The must-show run
again"). This script times, for one existing file (evicted from the page cache before every
run, then written to a scratch file beside it and fsynced), alternating, the ways a merge could
move its bytes:

- `cfr`: `copy_file_range` in 8 MB calls (what the merge does today);
- `direct`: the source read with O_DIRECT into an aligned buffer, the bytes shifted by 100
  (a tensor's offset in a data file is rarely 4096-aligned: the realignment copy a merge needs,
  done in user space, where a hash could read them while hot), written with O_DIRECT: no page
  cache on either side;
- `mmap_direct`: the source read through its page cache (a sequential mapping, the kernel's
  readahead), the same shifted copy, written with O_DIRECT.

    python benchmarks/copy_paths.py FILE --repeats 3

Prints wall, user and system CPU seconds (medians) and GB/s. O_DIRECT needs a file system that
supports it (ext4, xfs; not tmpfs). The scratch file is removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import evict  # fsync, then posix_fadvise DONTNEED

BLOCK = 8 << 20
SHIFT = 100  # a tensor's offset in its data file, not a multiple of the page size
ALIGN = 4096
SETTLE_S = 2.0  # rest before each run: the previous run's writeback and trim out of the way


def cfr(src: Path, dst: Path, size: int) -> None:
    s = os.open(src, os.O_RDONLY)
    d = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(d, 0, size)
        off = 0
        while off < size:
            off += os.copy_file_range(s, d, min(BLOCK, size - off), off, off)
        os.fsync(d)
    finally:
        os.close(s)
        os.close(d)


def _direct_writer(dst: Path, size: int) -> int:
    d = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    os.posix_fallocate(d, 0, size)
    return d


def direct(src: Path, dst: Path, size: int) -> None:
    s = os.open(src, os.O_RDONLY | os.O_DIRECT)
    d = _direct_writer(dst, size)
    read, out = mmap.mmap(-1, BLOCK + ALIGN), mmap.mmap(-1, BLOCK)
    try:
        off, end = 0, _aligned_end(size)
        while off < end:
            n = min(BLOCK, end - off)
            os.preadv(s, [memoryview(read)[: n + ALIGN]], off)
            out[:n] = read[SHIFT : SHIFT + n]
            os.pwrite(d, memoryview(out)[:n], off)
            off += n
        os.fsync(d)
    finally:
        os.close(s)
        os.close(d)


def mmap_direct(src: Path, dst: Path, size: int) -> None:
    s = os.open(src, os.O_RDONLY)
    d = _direct_writer(dst, size)
    source = mmap.mmap(s, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    source.madvise(mmap.MADV_SEQUENTIAL)
    out = mmap.mmap(-1, BLOCK)
    try:
        off, end = 0, _aligned_end(size)
        while off < end:
            n = min(BLOCK, end - off)
            out[:n] = source[off + SHIFT : off + SHIFT + n]
            os.pwrite(d, memoryview(out)[:n], off)
            off += n
        os.fsync(d)
    finally:
        source.close()
        os.close(s)
        os.close(d)


def _aligned_end(size: int) -> int:
    """The bytes the shifted paths move: whole pages, one page short of the end (the shift)."""
    return max(0, size - size % ALIGN - ALIGN)


METHODS: dict[str, Callable[[Path, Path, int], None]] = {
    "cfr": cfr,
    "direct": direct,
    "mmap_direct": mmap_direct,
}


def measure(method: Callable[[Path, Path, int], None], src: Path, dst: Path) -> tuple[float, ...]:
    size = src.stat().st_size
    evict([src])
    dst.unlink(missing_ok=True)
    os.sync()
    time.sleep(SETTLE_S)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    method(src, dst, size)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, size / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, help="an existing file (at least a few hundred MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    names = args.methods.split(",")
    dst = args.file.with_name(f".copy_paths-{os.getpid()}.tmp")
    runs: dict[str, list[tuple[float, ...]]] = {n: [] for n in names}
    try:
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(measure(METHODS[name], args.file, dst))
    finally:
        dst.unlink(missing_ok=True)
    print(f"{args.file} ({args.file.stat().st_size / 1e9:.2f} GB), cold, medians of {args.repeats}")
    print(f"{'path':12} {'wall s':>7} {'user s':>7} {'sys s':>7} {'GB/s':>6}")
    for name, rows in runs.items():
        wall, user, sys_, rate = (statistics.median(col) for col in zip(*rows, strict=True))
        print(f"{name:12} {wall:7.2f} {user:7.2f} {sys_:7.2f} {rate / 1e9:6.2f}")


if __name__ == "__main__":
    main()
