"""Helpers for the training tests: a tiny base model and data, and `shardforge train` runs.

Imported by name (`from train_helpers import ...`); the name is unique across the test tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from helpers.tiny import make_model, tiny_conversations, tiny_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def make_base(root: Path) -> dict[str, Any]:
    """A tiny Llama base model, completion data and chat data under `root`; return a config.

    The global batch is 12 sequences, so 1, 2 and 3 ranks can all run it (micro batch 12, 6, 4
    with gradient_accumulation_steps 1; or as set by the caller).
    """
    base = make_model(root / "base", "llama", vocab_size=320, seed=0)
    data = write_jsonl(root / "data.jsonl", [{"text": t} for t in tiny_texts(48, seed=1)])
    write_jsonl(root / "chats.jsonl", [{"messages": m} for m in tiny_conversations(16, seed=1)])
    return {
        "base_model": str(base),
        "output_dir": str(root / "out"),
        "seed": 7,
        "datasets": [{"path": str(data), "type": "completion", "field": "text"}],
        "sequence_len": 32,
        "sample_packing": True,
        "micro_batch_size": 3,
        "gradient_accumulation_steps": 2,
        "max_steps": 6,
        "learning_rate": 3.0e-3,
        "lr_scheduler": "cosine",
        "warmup_steps": 2,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_steps": 2,
        "fsdp": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    }


def write_config(path: Path, cfg: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def train_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def train_cmd(config: Path, *args: str, nproc: int = 2) -> list[str]:
    launch = ["--launcher", "python"] if nproc == 1 else ["--nproc_per_node", str(nproc)]
    return [sys.executable, "-m", "shardforge", "train", str(config), *launch, *args]


def run_train(
    config: Path, *args: str, nproc: int = 2, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real `shardforge train` CLI in a subprocess (torchrun for nproc > 1)."""
    proc = subprocess.run(
        train_cmd(config, *args, nproc=nproc),
        capture_output=True,
        text=True,
        env=train_env(env),
        cwd=ROOT,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir)}


class Run:
    """A finished `shardforge train` run: its output directory and what it printed."""

    def __init__(self, out: Path, stderr: str) -> None:
        self.out, self.stderr = out, stderr


def run_in(root: Path, cfg: dict[str, Any]) -> Run:
    """Train `cfg` on 2 ranks with its output in `root`/out (config at `root`/cfg.yml)."""
    out = root / "out"
    proc = run_train(write_config(root / "cfg.yml", {**cfg, "output_dir": str(out)}), nproc=2)
    return Run(out, proc.stderr)


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited meanwhile (a helper process of the launcher)
        return ""


def job_processes(job: subprocess.Popen[bytes], config: Path, ranks: int) -> list[psutil.Process]:
    """The launcher, torchrun and its `ranks` rank processes (all name `config`), once they
    all run."""
    deadline = time.monotonic() + 240
    while True:
        procs = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
        if sum(str(config) in _command(p) for p in procs) >= ranks + 2:
            return procs
        assert job.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


def kill_all(job: subprocess.Popen[bytes], procs: list[psutil.Process]) -> None:
    """SIGKILL every process of the job at once (no chance to clean up)."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    psutil.wait_procs(procs[1:], timeout=30)
