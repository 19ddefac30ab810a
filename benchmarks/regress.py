"""Regression benchmark: the standard merges with this tree and with a git ref, side by side.

    python benchmarks/regress.py --against 5554320
    python benchmarks/regress.py --against main --sizes 1GB,2GB --repeats 3 --only warm2,dry_run

The standard cases (issue 36), each a float32 Llama-shaped DCP checkpoint made by
`merge_bench.make_checkpoints` (real `dcp.save`):

- `warm2`: a 2-rank checkpoint of the first size (default 4 GB), page cache warm;
- `cold1`: a 1-rank checkpoint (one `.distcp`) of the first size, cold;
- `cold8`: a 2-rank checkpoint of the second size (default 8 GB), cold;
- `dry_run`: `--dry_run` on the `warm2` checkpoint (imports, metadata, the meta-device model,
  the plan: the fixed start-up cost).

Contenders: `current` (this tree's src/), `REF` (the ref checked out in a temporary
`git worktree`, its src/ on PYTHONPATH, the same installed packages), and as peers `cp -r` +
`sync` and accelerate's `merge_fsdp_weights` (`--peers` to choose; not in `dry_run`). Within a
case they alternate run by run (the first contender rotates each repeat), each in its own process
tree (`merge_bench.run_measured`: wall seconds, user CPU seconds, the peak of the tree's summed
RSS). Cold: the checkpoint's files are evicted from the page cache before every run
(`posix_fadvise(DONTNEED)` after an fsync: `merge_bench.evict`, no root, nothing else on the
machine dropped); warm: read once before every run. Before every run the disk is let settle
(`merge_bench.settle`) and rests `--pause` seconds. The weights written by `current` and `REF`
are compared byte for byte after the first repeat (`--no-compare` to skip), and `shardforge
verify` of current's `warm2` output is timed then, just written and warm (read once first).

The result is a markdown table (medians of `--repeats`, the ratios current / REF, the copy's
and accelerate's against current), ready to paste into a commit message, with the machine's
load averages before and after. Checkpoints and outputs go under `--workdir` and are removed at
the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_formats import checkpoint_files
from merge_bench import (
    command_for,
    evict,
    human,
    make_checkpoints,
    parse_size,
    run_measured,
    settle,
    warm,
)

REPO = Path(__file__).resolve().parent.parent
CASES = ("warm2", "cold1", "cold8", "dry_run")
PEERS = ("copy", "accelerate")
PEER_LABELS = {"copy": "cp -r + sync", "accelerate": "accelerate"}


@dataclass(frozen=True)
class Case:
    name: str
    size: str
    ranks: int
    cache: str  # "warm" or "cold"
    dry_run: bool = False

    def title(self) -> str:
        what = "--dry_run" if self.dry_run else f"{self.cache}"
        return f"{self.ranks}-rank {self.size} {what}"


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    user: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    failure: str = ""

    def median(self, what: str) -> float:
        values = getattr(self, what)
        return float(statistics.median(values)) if values else float("nan")


def cases(sizes: list[str], only: list[str]) -> list[Case]:
    first, second = sizes
    table = {
        "warm2": Case("warm2", first, 2, "warm"),
        "cold1": Case("cold1", first, 1, "cold"),
        "cold8": Case("cold8", second, 2, "cold"),
        "dry_run": Case("dry_run", first, 2, "warm", dry_run=True),
    }
    return [table[n] for n in only]


def worktree(ref: str, parent: Path) -> tuple[Path, str]:
    """`ref` checked out (detached) in a temporary worktree under `parent`; (path, short sha)."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", f"{ref}^{{commit}}"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix=f"regress-{sha}-", dir=parent))
    path.rmdir()
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path), sha],
        check=True,
    )
    return path, sha


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False
    )
    shutil.rmtree(path, ignore_errors=True)


def command(contender: str, case: Case, cfg: Path, ckpt: Path, out: Path, ref: Path) -> list[str]:
    if contender in PEERS:
        return command_for(contender, cfg, ckpt, out)
    name = "shardforge_dry_run" if case.dry_run else "shardforge"
    return command_for(name, cfg, ckpt, out, source=str(REPO if contender == "current" else ref))


def weights(out: Path) -> list[Path]:
    return sorted(out.glob("*.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return (
        bool(wa)
        and [p.name for p in wa] == [p.name for p in wb]
        and all(filecmp.cmp(x, y, shallow=False) for x, y in zip(wa, wb, strict=True))
    )


def run_case(case: Case, args: argparse.Namespace, ref: Path, label: str) -> dict[str, Samples]:
    """Every contender of `case`, `args.repeats` times, alternating."""
    root = Path(args.workdir) / f"llama-{case.size}-float32-{case.ranks}r"
    print(f"[{case.title()}] checkpoint {root}", file=sys.stderr)
    cfg, ckpts = make_checkpoints(root, parse_size(case.size), "float32", case.ranks, ["dcp"])
    files = checkpoint_files(root, "dcp")
    names = ["current", label] + ([] if case.dry_run else list(args.peers))
    results = {n: Samples() for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            res = results[name]
            if res.failure:
                continue
            out = root / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            (evict if case.cache == "cold" else warm)(files)
            settle(root)
            time.sleep(args.pause)
            run = run_measured(command(name, case, cfg, ckpts["dcp"], out, ref), None, root)
            if run.code != 0:
                tail = run.stderr_tail.strip().splitlines()
                res.failure = f"exit {run.code}: {tail[-1] if tail else ''}"
                print(f"  {name}: FAILED ({res.failure})", file=sys.stderr)
                continue
            res.wall.append(run.seconds)
            res.user.append(run.user)
            res.rss.append(run.tree_rss)
            print(f"  run {rep + 1} {name}: {run.seconds:.2f} s, user {run.user:.2f} s, "
                  f"RSS {human(run.tree_rss)}, load {os.getloadavg()[0]:.2f}", file=sys.stderr)  # fmt: skip
            if not (rep == 0 and args.compare and name in ("current", label)):
                shutil.rmtree(out, ignore_errors=True)  # (the two compared first are kept)
        a, b = root / "out-current", root / f"out-{label}"
        if rep == 0 and case.name == "warm2" and a.exists():
            verify_speed(a, root, results)
        compared = rep == 0 and args.compare and not case.dry_run
        if compared and a.exists() and b.exists() and not same_weights(a, b):
            results["current"].failure = f"weights differ from {label}'s"
            print(f"  current's weights differ from {label}'s", file=sys.stderr)
        for name in names:
            shutil.rmtree(root / f"out-{name}", ignore_errors=True)
    return results


def verify_speed(out: Path, root: Path, results: dict[str, Samples]) -> None:
    """`shardforge verify` of current's output, timed twice: just written (`verify_written`:
    the merge writes its weights with O_DIRECT, so they are not in the page cache then) and
    warm (`verify`: the output read once first), each kept as a pseudo-contender (its bytes
    per second printed under the table)."""
    cmd = [str(Path(sys.executable).parent / "shardforge"), "verify", str(out)]
    for name in ("verify_written", "verify"):
        if name == "verify":
            warm(sorted(p for p in out.iterdir() if p.is_file()))
        run = run_measured(["env", f"PYTHONPATH={REPO / 'src'}", *cmd], None, root)
        res = results.setdefault(name, Samples())
        if run.code != 0:
            res.failure = f"exit {run.code}: {run.stderr_tail.strip()[-200:]}"
            return
        res.wall.append(run.seconds)
        res.rss.append(sum(p.stat().st_size for p in out.iterdir()))  # (the bytes verified)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b == b and a == a and b > 0 else "-"


def table(rows: list[tuple[Case, dict[str, Samples]]], label: str, peers: list[str]) -> str:
    """The markdown table: medians, current / REF, and the peers against current."""
    head = ["case", "wall current s", f"wall {label} s", f"current / {label}",
            "user CPU current s", f"user CPU {label} s", "ratio",
            "peak RSS current", f"peak RSS {label}", "ratio"]  # fmt: skip
    for p in peers:
        head += [f"{PEER_LABELS[p]} s", "current / copy" if p == "copy" else f"{p} / current"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, res in rows:
        cur, old = res["current"], res[label]
        cells = [case.title()]
        if cur.failure or old.failure:
            cells.append(f"failed: {cur.failure or old.failure}")
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cw, ow = cur.median("wall"), old.median("wall")
        cu, ou = cur.median("user"), old.median("user")
        cr, orss = cur.median("rss"), old.median("rss")
        cells += [f"{cw:.2f}", f"{ow:.2f}", ratio(cw, ow), f"{cu:.2f}", f"{ou:.2f}", ratio(cu, ou),
                  human(cr), human(orss), ratio(cr, orss)]  # fmt: skip
        for p in peers:
            peer = res.get(p)
            if peer is None or not peer.wall:
                cells += ["-", "-"]
                continue
            pw = peer.median("wall")
            cells += [f"{pw:.2f}", ratio(cw, pw) if p == "copy" else ratio(pw, cw)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="a git ref (commit, tag, branch)")
    parser.add_argument("--sizes", default="4GB,8GB", help="the two sizes (decimal units)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--peers", default=",".join(PEERS), help="copy,accelerate or none")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of rest before a run")
    parser.add_argument("--workdir", default="/work/bench-tmp/regress")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--no-compare", dest="compare", action="store_false")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",")]
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    args.peers = [p for p in args.peers.split(",") if p in PEERS]
    if len(sizes) != 2 or set(only) - set(CASES) or args.repeats < 1:
        parser.error(f"--sizes A,B; --only of {', '.join(CASES)}; --repeats >= 1")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the worktree removed on a kill too
    ref, sha = worktree(args.against, workdir)
    load_before = os.getloadavg()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    rows = []
    try:
        for case in cases(sizes, only):
            rows.append((case, run_case(case, args, ref, sha)))
    finally:
        remove_worktree(ref)
        if not args.keep:
            for p in workdir.glob("llama-*"):
                shutil.rmtree(p, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"\ncurrent: {head}{' + uncommitted src changes' if dirty else ''}; against {sha} "
          f"({args.against}); medians of {args.repeats}, alternating; {os.cpu_count()} cores; "
          f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}\n")  # fmt: skip
    print(table(rows, sha, args.peers))
    for case, res in rows:
        for name, when in (("verify_written", "just written"), ("verify", "warm")):
            v = res.get(name)
            if v is not None and v.wall:
                gbs = v.rss[0] / v.median("wall") / 1e9
                print(f"\n`shardforge verify` of current's {case.title()} output, {when}: "
                      f"{v.median('wall'):.2f} s, {gbs:.2f} GB/s (start-up included)")  # fmt: skip
            elif v is not None:
                print(f"\n`shardforge verify` ({when}) failed: {v.failure}")
    for case, res in rows:
        runs = "; ".join(
            f"{n}: " + ", ".join(f"{w:.2f}" for w in s.wall)
            for n, s in res.items()
            if s.wall and not n.startswith("verify")
        )
        print(f"\n{case.title()} wall s per run: {runs}", end="")
    print()


if __name__ == "__main__":
    main()
