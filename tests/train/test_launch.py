"""The torchrun command line `train` builds for one and many machines."""

from __future__ import annotations

import sys

from shardforge.train.launch import LaunchOptions, torchrun_command


def test_single_machine_is_standalone() -> None:
    cmd = torchrun_command("cfg.yml", ["--max_steps", "3"], LaunchOptions(nproc_per_node=2))
    assert cmd == [
        sys.executable,
        "-m",
        "shardforge.train.torchrun",  # torch.distributed.run, quiet about reported rank errors
        "--nproc_per_node",
        "2",
        "--standalone",
        "-m",
        "shardforge.cli.train_rank",
        "cfg.yml",
        "--max_steps",
        "3",
    ]


def test_multi_machine_options_are_passed_through() -> None:
    opts = LaunchOptions(
        nproc_per_node=8, nnodes="2", node_rank=1, rdzv_endpoint="h0:29500", rdzv_id="job"
    )
    cmd = torchrun_command("cfg.yml", [], opts)
    assert "--standalone" not in cmd
    text = " ".join(cmd)
    assert "--nnodes 2 --node_rank 1 --rdzv_endpoint h0:29500 --rdzv_id job" in text
    assert cmd[-3:] == ["-m", "shardforge.cli.train_rank", "cfg.yml"]


def test_training_never_imports_the_merge() -> None:
    import subprocess

    code = (
        "import sys, shardforge.cli.train, shardforge.cli.train_rank, shardforge.train.loop, "
        "shardforge.train.preflight\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('shardforge.inspection', "
        "'shardforge.merge')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
