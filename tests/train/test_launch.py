"""The torchrun command line `train` builds for one and many machines; the ranks it starts end
with the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from train_helpers import ROOT, job_processes, train_cmd, train_env, write_config

from helpers.gate import Gate
from helpers.procs import still_running
from shardforge.config import load_cfg
from shardforge.io.lock import OutputLocked
from shardforge.train.launch import LaunchOptions, torchrun_command
from shardforge.train.runtime import Runtime, output_dir_lock


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


# One child process for the two tests below (its imports cost seconds): it imports the training
# side, reports which merge modules came with it, then runs a rank's entry with a stand-in for
# the training.
_RANK_CHILD = (
    "import json, sys, shardforge.cli.train, shardforge.cli.train_rank, shardforge.train.loop, "
    "shardforge.train.preflight\n"
    "bad = sorted(m for m in sys.modules if m.startswith(('shardforge.inspection', "
    "'shardforge.merge')))\n"
    "print('imported: ' + json.dumps(bad), flush=True)\n"
    "import logging, shardforge.cli.train_rank as rank, shardforge.train.loop as loop\n"
    "import shardforge.train.launch as launch\n"
    "launch.load_checked = lambda path, overrides: None\n"
    "loop.run_training = lambda cfg, keep_group=False: "
    "logging.getLogger('shardforge').info('step 1/2')\n"
    "rank.main(['cfg.yml'])\n"
)


@pytest.fixture(scope="module")
def rank_child() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RANK_CHILD], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # python -c
def test_training_never_imports_the_merge(rank_child: subprocess.CompletedProcess[str]) -> None:
    import json

    (line,) = [x for x in rank_child.stdout.splitlines() if x.startswith("imported: ")]
    bad = json.loads(line.removeprefix("imported: "))
    assert bad == [], bad


@pytest.mark.slow
def test_a_training_ranks_log_lines_start_with_the_time(
    rank_child: subprocess.CompletedProcess[str],
) -> None:
    """A rank's lines carry the time of day (the compile, an evaluation, a save: how long
    each took shows); the rank's entry run with a stand-in for the training."""
    import re

    assert rank_child.returncode == 0, rank_child.stderr[-3000:]
    lines = [line for line in rank_child.stderr.splitlines() if "step 1/2" in line]
    assert len(lines) == 1 and re.fullmatch(r"\d\d:\d\d:\d\d step 1/2", lines[0]), lines


@pytest.mark.slow
def test_kill_9_of_the_command_ends_torchrun_and_every_rank(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """`kill -9` of the `shardforge train` process alone (its torchrun agent and the ranks,
    each in a session of its own, are not signalled) while rank 0 is about to write its first
    checkpoint (a test gate before the mkdir of checkpoint-2.tmp): the agent and both ranks
    end within seconds and no checkpoint is written, although the gate then lets rank 0 go on.
    While the run lives, rank 0 holds output_dir's lock: another writer is refused, naming it.
    (`kill -9` of the command's process group: tests/merge/test_distributed.py, the same
    launcher code.)"""
    out = tmp_path / "out"
    cfg = {**base_cfg, "output_dir": str(out), "max_steps": 4, "save_steps": 2}
    config = write_config(tmp_path / "cfg.yml", cfg)
    gate = Gate(tmp_path / "gate", "os:mkdir", r"/checkpoint-2\.tmp$", after=False)
    job = subprocess.Popen(
        train_cmd(config, nproc=2),
        cwd=ROOT,
        env=gate.env(train_env()),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        (paused,) = gate.wait(job)
        family = [p.pid for p in job_processes(job, config, ranks=2)[1:]]  # torchrun, ranks
        (agent,) = psutil.Process(job.pid).children()
        rank0 = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        held = rf"in use by shardforge train \(rank 0 of 2\) \(pid {paused} "
        second = output_dir_lock(load_cfg(config, command="train"), rank0)
        with pytest.raises(OutputLocked, match=held), second:
            pytest.fail("a second writer took the output_dir of a running run")
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        # once the agent has ended, its end has sent SIGKILL to the ranks: they run no more
        # code (the few milliseconds a process takes to die are not what is tested here)
        still_running([agent.pid], seconds=10)
    finally:
        gate.open()  # a rank that outlived the kill goes on (and would write checkpoint-2)
        if job.poll() is None:
            job.kill()
    assert not still_running(family, seconds=10), "processes of the run outlived the kill"
    assert not list(out.glob("checkpoint-*")), sorted(p.name for p in out.iterdir())
