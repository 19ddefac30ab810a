"""Time and peak memory of reading crafted DCP `.metadata` files and configs up to their caps.

    python benchmarks/metadata_bound.py                       # every case at the .metadata cap
    python benchmarks/metadata_bound.py --size 8MiB --cases "memo fill,real 256 ranks"

Issue 35 (item 5): a crafted `.metadata` of any size up to the cap, and any config up to its
cap, is refused or read within 10 s and 1 GB of memory. Each case is a file written once under
a temporary folder and read in a fresh process (`shardforge.formats.dcp.pickles.
load_metadata_pickle`, or `config.loader.read_yaml` for configs): the table gives what happened
(read or the refusal), the wall and CPU seconds of the read alone, and the peak RSS the read
added to the process (`ru_maxrss` after the read less the RSS before it: the file's bytes
included). Cases: `real N ranks` is a `.metadata` shaped as `dcp.save` writes it for an FSDP2
Llama-shaped model with Adam states over N ranks (`tests/helpers/dcp_metadata.py`, grown to
the size), every other `.metadata` case an attack of `dcp_metadata.CRAFTED`; the `config ...`
cases are YAML files at the config cap (4 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CONFIG_CASES = {  # YAML at the config cap: a long list, many keys, an alias bomb
    "config 2M-int list": lambda n: "x:\n" + "- 1\n" * ((n - 3) // 4),
    "config many keys": lambda n: "".join(f"k{i}: 1\n" for i in range(n // 11)),
    "config alias bomb": lambda n: (
        "a: &a [1,1,1,1,1,1,1,1,1,1]\n"
        + "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}]\n" for i in range(40))
        + "c: ["
        + ",".join(["*b39"] * max(1, (n - 900) // 6))
        + "]\n"
    ),
}


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _status(field: str) -> int:
    """A size from /proc/self/status in bytes (VmRSS, VmHWM: the peak, reset by exec)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def child(path: str, kind: str) -> None:
    """Read one file (in this fresh process) and print what it cost as JSON."""
    from shardforge.config.loader import read_yaml
    from shardforge.errors import ShardforgeError
    from shardforge.formats.dcp.pickles import load_metadata_pickle

    before = _status("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        (read_yaml if kind == "config" else load_metadata_pickle)(path)
        outcome = "read"
    except ShardforgeError as exc:
        outcome = "refused: " + str(exc).split(": ", 1)[1][:90]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = _status("VmHWM") - before
    print(json.dumps({"outcome": outcome, "wall": wall, "cpu": cpu, "peak": peak}))


def measure(path: Path, kind: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}")
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), kind],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def make(name: str, size: int) -> tuple[bytes, str]:
    from helpers.dcp_metadata import CRAFTED, metadata_of_size

    if name in CONFIG_CASES:
        return CONFIG_CASES[name](4 << 20).encode(), "config"
    if name.startswith("real "):
        return metadata_of_size(size, ranks=int(name.split()[1])), "metadata"
    return CRAFTED[name](size), "metadata"


def main() -> None:
    from helpers.dcp_metadata import CRAFTED
    from shardforge.formats.dcp.pickles import METADATA_MAX_BYTES

    cases = ["real 256 ranks", *CRAFTED, *CONFIG_CASES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=str(METADATA_MAX_BYTES), help="`.metadata` size")
    parser.add_argument("--cases", default=",".join(cases), help="comma-separated case names")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    size = parse_size(args.size)
    print("| case | file | outcome | wall s | CPU s | peak MB |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="metadata-bound-") as tmp:
        for name in args.cases.split(","):
            data, kind = make(name, size)
            path = Path(tmp) / ("config.yml" if kind == "config" else ".metadata")
            path.write_bytes(data)
            r = measure(path, kind)
            print(
                f"| {name} | {len(data) / 1e6:.1f} MB | {r['outcome']} | {r['wall']:.2f} | "
                f"{r['cpu']:.2f} | {int(r['peak']) / 1e6:.0f} |",
                flush=True,
            )
            path.unlink()


if __name__ == "__main__":
    main()
