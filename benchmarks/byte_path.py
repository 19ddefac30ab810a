"""The merge's byte path alone: how the file-to-file copies are run, against the disk.

Plans the copy jobs the merge makes for a DCP checkpoint (its early copy's plan: every tensor a
file-to-file slab, `merge.overlap._guess`), then runs them into scratch output files with each
strategy, alternating strategies run by run, cold cache (the data files evicted before every
run) and the disk settled and rested before every run (as `merge_bench.py`). Each run ends with
an fsync of the outputs. Printed per strategy: wall seconds and this process's CPU seconds (user
and kernel, every thread; the kernel's write-back threads are not counted), medians.

In the merge the copy overlaps the start-up (transformers imported, the model built on the meta
device), and both want the CPU. `--with-startup` starts that start-up in a child process at the
same moment as every copy and reports its seconds too (column `start-up s`): a copy strategy
that takes CPU from it delays the merge even when the copy alone is as fast.

A strategy is `threads x order`:

- threads: how many threads run the jobs of one output file at once (the merge used 4 until
  issue 12's profile; it now uses 1);
- order: `plan` (the output's tensor order, as the merge copied before) or `source` (sorted by
  data file and offset: each data file read front to back, as the merge copies without a
  manifest); `hashed`: the merge's copy into a file whose SHA-256 its integrity manifest
  records (`io.digest`: jobs in output order, each source block mapped, hashed in turn and
  copied in the kernel); `buffered`: the alternative it was measured against (each block read
  into a buffer, hashed and written back; one thread).

`none` copies nothing: with `--with-startup`, the start-up's time on its own.

    python benchmarks/byte_path.py .bench/llama-4GB-float32-2r/bench.yml \\
        .bench/llama-4GB-float32-2r/out/checkpoint-1/pytorch_model_fsdp_0 --repeats 3 \\
        --with-startup
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import evict, settle

STRATEGIES = ("4x plan", "1x plan", "4x source", "1x source", "1x hashed", "1x buffered")
HASH_BUFFER = 8 << 20  # the `buffered` strategy's block

# what the merge does while its early copy runs (merge.prepare._architecture)
STARTUP = r"""
import sys, time
t0 = time.perf_counter()
from shardforge.merge import prepare as api
api._architecture(sys.argv[1], False)
print(time.perf_counter() - t0)
"""


def plan_jobs(
    cfg_path: str, ckpt: str
) -> tuple[list[tuple[str, int, list[tuple]]], list[Path], str]:
    """[(output file name, size, [(src path, src offset, dst offset, nbytes), ...])], the data
    files, the model config's folder."""
    from shardforge.config import load_cfg
    from shardforge.formats.dcp.chunks import entry_slabs
    from shardforge.io.copy import ReadCache
    from shardforge.layouts.catalog import resolve_checkpoint
    from shardforge.merge import overlap

    cfg = load_cfg(cfg_path, command="merge")
    candidate = resolve_checkpoint(ckpt)
    guess = overlap._guess(candidate, str(cfg.base_model), None, None)
    if guess is None:
        raise SystemExit(f"{ckpt}: not a checkpoint the early copy plans (see merge/overlap.py)")
    files = []
    with ReadCache() as reader:
        for pf in guess.plan.files:
            jobs = []
            for planned in pf.tensors:
                slabs = entry_slabs(guess.entries[planned.spec.name], reader)
                if slabs is None:
                    raise SystemExit(f"{planned.spec.name}: not a file-to-file slab")
                jobs += [
                    (str(s.path), s.src_offset, planned.offset + s.dst_offset, s.nbytes)
                    for s in slabs
                ]
            files.append((pf.name, pf.size, jobs))
    data = sorted(p for p in candidate.model_dir.iterdir() if p.is_file())
    return files, data, str(cfg.base_model)


def copy_one(src: str, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    """One job, with the merge's own file-to-file copy (`copy_range`)."""
    from shardforge.io.copy import copy_range

    fd = os.open(src, os.O_RDONLY)
    try:
        copy_range(fd, dst_fd, src_off, dst_off, n)
    finally:
        os.close(fd)


def hashed_copy(fd: int, jobs: list[tuple], threads: int, buffered: bool) -> str:
    """The jobs into `fd` with the manifest's hash taken from the written bytes (the header's
    bytes, not copied here, hashed as zeros); the hex digest."""
    from shardforge.io.copy import CopyJob, copy_jobs, copy_range
    from shardforge.io.digest import FileHash, hashing

    h = FileHash(Path(os.readlink(f"/proc/self/fd/{fd}")))
    todo = sorted(jobs, key=lambda j: j[2])
    h.written(0, todo[0][2])
    if not buffered:
        with hashing(fd, h):
            copy_jobs([CopyJob(Path(s), so, fd, do, n) for s, so, do, n in todo], copy_range,
                      threads=threads)  # fmt: skip
    for src, so, do, n in todo if buffered else ():
        sfd = os.open(src, os.O_RDONLY)
        try:
            for at in range(0, n, HASH_BUFFER):
                block = os.pread(sfd, min(HASH_BUFFER, n - at), so + at)
                os.pwrite(fd, block, do + at)
                h.written(do + at, len(block))
        finally:
            os.close(sfd)
    return h.hexdigest(todo[-1][2] + todo[-1][3])


def run(strategy: str, files: list[tuple[str, int, list[tuple]]], out_dir: Path) -> float:
    if strategy == "none":  # no copy: the start-up alone (with --with-startup)
        return 0.0
    threads_text, order = strategy.split("x ")
    threads = int(threads_text)
    start = time.perf_counter()
    for name, size, jobs in files:
        fd = os.open(out_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
            todo = sorted(jobs, key=lambda j: (j[0], j[1])) if order == "source" else jobs
            if order in ("hashed", "buffered"):
                hashed_copy(fd, jobs, threads, buffered=order == "buffered")
            elif threads == 1:
                for src, so, do, n in todo:
                    copy_one(src, so, fd, do, n)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    for f in [pool.submit(copy_one, s, so, fd, do, n) for s, so, do, n in todo]:
                        f.result()
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("checkpoint", help="the model's DCP directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--pause", type=float, default=5.0, help="rest before every run (s)")
    parser.add_argument("--workdir", default=None, help="where the scratch outputs go")
    parser.add_argument(
        "--with-startup",
        action="store_true",
        help="run the merge's start-up (transformers, meta-device model) beside every copy",
    )
    args = parser.parse_args()
    strategies = [s.strip() for s in args.strategies.split(",")]
    files, data, config_source = plan_jobs(args.config, args.checkpoint)
    total = sum(n for _, _, jobs in files for *_, n in jobs)
    jobs = sum(len(j) for _, _, j in files)
    print(f"{len(files)} output file(s), {jobs} copy jobs, {total / 1e9:.2f} GB", file=sys.stderr)
    wall: dict[str, list[float]] = {s: [] for s in strategies}
    cpu: dict[str, list[float]] = {s: [] for s in strategies}
    startup: dict[str, list[float]] = {s: [] for s in strategies}
    workdir = Path(args.workdir or Path(args.checkpoint).parent)
    for rep in range(args.repeats):
        order = strategies[rep % len(strategies) :] + strategies[: rep % len(strategies)]
        for s in order:
            with tempfile.TemporaryDirectory(dir=workdir, prefix=".byte-path-") as tmp:
                evict(data)
                settle(workdir)
                time.sleep(args.pause)
                child = None
                if args.with_startup:
                    cmd = [sys.executable, "-c", STARTUP, config_source]
                    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                before = os.times()
                seconds = run(s, files, Path(tmp))
                after = os.times()
                if child is not None:
                    out, _ = child.communicate()
                    if child.returncode != 0:
                        raise SystemExit(f"the start-up child failed (exit {child.returncode})")
                    startup[s].append(float(out.strip().splitlines()[-1]))
            used = (after.user - before.user) + (after.system - before.system)
            wall[s].append(seconds)
            cpu[s].append(used)
            extra = f", start-up beside it {startup[s][-1]:.2f} s" if startup[s] else ""
            print(f"  run {rep + 1} {s}: {seconds:.2f} s, CPU {used:.2f} s{extra}", file=sys.stderr)
    print(f"\n{total / 1e9:.2f} GB, cold cache, disk settled + {args.pause:g} s rest; medians of "
          f"{args.repeats}; {os.cpu_count()} cores")  # fmt: skip
    print(f"{'strategy':<12}{'wall s':>8}{'GB/s':>7}{'CPU s':>8}{'start-up s':>12}  runs (wall s)")
    for s in strategies:
        w = statistics.median(wall[s])
        runs = ", ".join(f"{x:.2f}" for x in wall[s])
        up = f"{statistics.median(startup[s]):.2f}" if startup[s] else "-"
        rate = f"{total / w / 1e9:>7.2f}" if w else f"{'-':>7}"
        print(f"{s:<12}{w:>8.2f}{rate}{statistics.median(cpu[s]):>8.2f}{up:>12}  {runs}")


if __name__ == "__main__":
    main()
