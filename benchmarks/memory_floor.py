"""The floor under a merge's peak RSS: what the process holds before it moves a tensor byte.

Each probe is a fresh process (cold imports, as a real merge starts) whose peak RSS
(`VmHWM` at its end) is recorded; every probe runs `--repeats` times, alternating, and the
medians are printed with their share of the checkpoint and the distance to a ceiling
(`--ceiling`, 10 % of the checkpoint by default, as issue 23 asks of the S3 merge):

- python: the interpreter alone
- s3 client: `import s3fs` and one request (a listing) to the loopback S3 server
- torch: `import torch`
- architecture: torch, transformers, the checkpoint's config and the model built on the meta
  device (the step every merge takes: it checks the checkpoint against that architecture)
- architecture + s3 client: both in one process (what a one-process S3 merge holds at least)
- merge dry run (local), merge dry run (s3): `shardforge merge-sharded-fsdp-weights --dry_run`
  of the checkpoint on disk and in object storage (imports, metadata, architecture, every
  check and the plan; no byte written)
- merge (s3 -> s3), with `--full`: the whole streamed merge, object storage to object storage

The S3 probes use a SeaweedFS started on loopback (tests/helpers/s3.py); the checkpoint is
uploaded once, untimed.

    python benchmarks/memory_floor.py CFG CHECKPOINT_DIR --repeats 2
    python benchmarks/memory_floor.py .bench/llama-4GB-float32-2r/bench.yml \\
        .bench/llama-4GB-float32-2r/out/checkpoint-1/pytorch_model_fsdp_0 --full
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers.s3

PEAK = "print(int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]))"
S3_CLIENT = """
import json, os, s3fs
s3fs.S3FileSystem(**json.loads(os.environ["FLOOR_S3"])).ls(os.environ["FLOOR_BUCKET"])
"""
ARCHITECTURE = """
import os, torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(os.environ["FLOOR_CONFIG"])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(config)
"""
# the probes run by `python -c` (then their peak RSS is printed): name -> code
CODE_PROBES = {
    "python": "",
    "s3 client": S3_CLIENT,
    "torch": "import torch",
    "architecture": ARCHITECTURE,
    "architecture + s3 client": ARCHITECTURE + S3_CLIENT,
}
# run as a child of a small launcher: the peak RSS of the merge process (ru_maxrss)
LAUNCHER = """
import os, resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def human(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def merge_command(cfg: str, ckpt: str, out: str, *extra: str) -> list[str]:
    exe = str(Path(sys.executable).parent / "shardforge")
    return [exe, "merge-sharded-fsdp-weights", cfg, "--checkpoint", ckpt, "--output_path", out,
            "--quiet", "--no-save-tokenizer", *extra]  # fmt: skip


def code_command(code: str, i: int) -> list[str]:
    return [sys.executable, "-c", code + "\n" + PEAK]


def peak_kb(cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {cmd[:3]} failed:\n{proc.stderr[-2000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def probes(args: argparse.Namespace, scratch: Path) -> dict[str, Callable[[int], list[str]]]:
    """name -> the command of its run number `i` (each prints its peak RSS in kB last)."""
    table: dict[str, Callable[[int], list[str]]] = {
        name: functools.partial(code_command, code) for name, code in CODE_PROBES.items()
    }
    launch = [sys.executable, "-c", LAUNCHER]
    table["merge dry run (local)"] = lambda i: [
        *launch,
        *merge_command(args.config, args.checkpoint, str(scratch / f"out{i}"), "--dry_run"),
    ]
    table["merge dry run (s3)"] = lambda i: [
        *launch,
        *merge_command(args.config, "s3://floor/ckpt", f"s3://floor/dry{i}", "--dry_run"),
    ]
    if args.full:
        table["merge (s3 -> s3)"] = lambda i: [
            *launch,
            *merge_command(args.config, "s3://floor/ckpt", f"s3://floor/out{i}"),
        ]
    return table


def measure(args: argparse.Namespace, server: object, scratch: Path) -> dict[str, list[int]]:
    env = server.env()  # type: ignore[attr-defined]  # AWS variables of the loopback server
    env.update(
        FLOOR_S3=json.dumps(server.storage_options),  # type: ignore[attr-defined]
        FLOOR_BUCKET="floor",
        FLOOR_CONFIG=args.model_config,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    table = probes(args, scratch)
    runs: dict[str, list[int]] = {name: [] for name in table}
    for i in range(args.repeats):
        for name, cmd in table.items():  # alternating: every probe once per round
            kb = peak_kb(cmd(i), env)
            runs[name].append(kb * 1024)
            print(f"  run {i + 1} {name}: {human(kb * 1024)}", file=sys.stderr)
    return runs


def report(runs: dict[str, list[int]], ckpt_bytes: int, ceiling: float) -> None:
    line = ckpt_bytes * ceiling
    print(f"checkpoint {human(ckpt_bytes)}; ceiling {ceiling:.0%} = {human(line)}")
    print(f"{'probe':<28}{'peak RSS':>12}{'/ckpt':>8}{'vs ceiling':>13}  runs")
    for name, values in runs.items():
        med = statistics.median(values)
        listed = ", ".join(human(v) for v in values)
        print(
            f"{name:<28}{human(med):>12}{med / ckpt_bytes:>8.1%}{human(med - line):>13}  {listed}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="the shardforge config of the merge")
    parser.add_argument("checkpoint", help="the checkpoint folder (DCP) on disk")
    parser.add_argument("--model-config", help="folder of config.json (default: base_model)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ceiling", type=float, default=0.10, help="share of the checkpoint")
    parser.add_argument("--full", action="store_true", help="also the whole S3 -> S3 merge")
    args = parser.parse_args()
    from helpers.s3 import start_server
    from shardforge.config import load_cfg

    args.model_config = args.model_config or str(load_cfg(args.config).base_model)
    files = [p for p in Path(args.checkpoint).rglob("*") if p.is_file()]
    ckpt_bytes = sum(p.stat().st_size for p in files if p.suffix == ".distcp")
    scratch = Path(tempfile.mkdtemp(prefix="memory-floor-"))
    server = start_server(scratch / "s3", volume_size_mb=1024)
    try:
        bucket = server.bucket("floor")
        server.fs().put(args.checkpoint.rstrip("/") + "/", f"{bucket}/ckpt/", recursive=True)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        runs = measure(args, server, scratch)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report(runs, ckpt_bytes, args.ceiling)


if __name__ == "__main__":
    main()
