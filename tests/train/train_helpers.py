"""Helpers for the training tests: a tiny base model and data, and `shardforge train` runs.

Imported by name (`from train_helpers import ...`); the name is unique across the test tree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from helpers.dist import run_on_ranks
from helpers.shared import shared_folder
from helpers.tiny import make_model, tiny_conversations, tiny_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def make_base(root: Path) -> dict[str, Any]:
    """A tiny Llama base model, completion data and chat data under `root`; return a config.

    The global batch is 12 sequences, so 1, 2 and 3 ranks can all run it (micro batch 12, 6, 4
    with gradient_accumulation_steps 1; or as set by the caller).
    """
    make_model(root / "base", "llama", vocab_size=320, seed=0)
    write_jsonl(root / "data.jsonl", [{"text": t} for t in tiny_texts(48, seed=1)])
    write_jsonl(root / "chats.jsonl", [{"messages": m} for m in tiny_conversations(16, seed=1)])
    return base_config(root)


def base_config(root: Path) -> dict[str, Any]:
    """The config that trains `make_base`'s model on its completion data (output in root/out)."""
    return {
        "base_model": str(root / "base"),
        "output_dir": str(root / "out"),
        "seed": 7,
        "datasets": [{"path": str(root / "data.jsonl"), "type": "completion", "field": "text"}],
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
    proc.stderr = untimed(proc.stderr)
    return proc


TIME = re.compile(r"^\d\d:\d\d:\d\d ", re.MULTILINE)  # a training rank's log line starts so


def untimed(text: str) -> str:
    """The output without the times of day that start a training rank's log lines."""
    return TIME.sub("", text)


def launch_train(
    config: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None
) -> str:
    """`shardforge train CONFIG --nproc_per_node N ARGS` with its launcher in this process
    (`launch.do_train`: the config's checks, then torchrun and the ranks, real child processes);
    what the command prints on stderr (the launcher's log lines, torchrun's and the ranks'
    output, in order). For the tests of what training does: a launcher process of its own
    costs seconds of imports. The command's own process is tested through `run_train`."""
    import tempfile

    from shardforge.errors import ShardforgeError
    from shardforge.train.launch import LaunchOptions, do_train

    with tempfile.TemporaryDirectory(prefix="shardforge-train-") as tmp:
        log = Path(tmp) / "stderr"
        with _environment(train_env(env)), _stderr_to(log):
            try:
                do_train(config, list(args), "torchrun", LaunchOptions(nproc_per_node=nproc))
                failed = None
            except ShardforgeError as exc:
                failed = exc
        stderr = log.read_text()
    if failed is not None:
        raise AssertionError(f"train failed ({failed.message}):\n{stderr[-4000:]}")
    return untimed(stderr)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ is `env` in the block (the child processes' environment)."""
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (the child processes' stderr) and shardforge's log records, appended
    to `path` in the order they are written."""
    import logging

    logger = logging.getLogger("shardforge")
    level = logger.level
    with path.open("a", encoding="utf-8") as f:
        handler = logging.StreamHandler(f)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            logger.removeHandler(handler)
            logger.setLevel(level)


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def losses(output_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(output_dir)}


class Run:
    """A finished `shardforge train` run: its output directory, what it printed and (where
    known) its config file."""

    def __init__(self, out: Path, stderr: str, config: Path | None = None) -> None:
        self.out, self.stderr, self.config = out, stderr, config

    @property
    def cfg(self) -> dict[str, Any]:
        assert self.config is not None
        data: dict[str, Any] = yaml.safe_load(self.config.read_text())
        return data


def shared_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`make_base`, made once per test run for every module and xdist worker (no process is
    started for it). Read only: its output_dir is for the caller to replace."""
    return base_config(shared_folder(tmp_path_factory, "train-base", make_base, False))


LORA = {
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "lora_target_modules": ["q_proj", "v_proj"],
    "learning_rate": 2.0e-2,
}
# QLoRA: LORA over NF4 base weights
QLORA = {"adapter": "qlora", "load_in_4bit": True}
# a held-out split evaluated before the first step, every 2 steps and after the last (0, 2, 4,
# 5), in the same chunks at any world size
EVALUATED = {
    "val_set_size": 0.1,
    "eval_steps": 2,
    "eval_batch_size": 2,
    "max_steps": 5,
    "save_steps": None,
}

# 10 steps that save nothing (no checkpoint, no final model), in windows of 96 tokens that each
# hold several samples or padding (so every micro-batch has an attention mask: see
# test_compile.py)
# the chunked loss on (off by default, as Axolotl): the runs exercise it, compiled and eager
UNSAVED_10 = {
    "max_steps": 10,
    "save_steps": None,
    "save_strategy": "no",
    "sequence_len": 96,
    "chunked_cross_entropy": True,
}


# Axolotl's options where sharding matters: a block half frozen (its MLP trained, its
# attention frozen) and the embedding's rows from 100 on; int4 fake quantization; checkpoints
# without optimizer state (4 steps, a checkpoint every 2)
OPTIONS = {
    "unfrozen_parameters": ["^model.layers.1.mlp.", "^model.embed_tokens.weight$[100:]"],
    "qat": {"weight_dtype": "int4", "activation_dtype": "int8", "group_size": 32},
    "save_only_model": True,
    "max_steps": 4,
}


def _shared_runs(base: dict[str, Any], root: Path) -> dict[str, dict[str, Any]]:
    """The 2-rank runs tests compare with: name -> what it changes in the shared base's config.

    reference: 6 steps, a checkpoint every 2; evaluated: `EVALUATED`; async: async_save;
    eager-10 / compiled-10: 10 steps saving nothing (save_strategy: no), the second with
    torch_compile (backend aot_eager: inductor's C++ compile would take minutes here);
    merging: merge_on_save, save_total_limit 2; packed: windows of 96 tokens (several samples
    each); full-state-dict: FULL_STATE_DICT; lora-llama: `LORA`; lora-qwen: a tied-embedding
    Qwen2 (root/qwen-base) with every linear layer adapted and the embedding trained (4 steps);
    qlora-* / int8-*: lora-llama and lora-qwen over NF4 / int8 base weights (4 steps).
    options: `OPTIONS`.
    """
    fsdp = base["fsdp"]
    lora_qwen = {
        **LORA,
        "base_model": str(root / "qwen-base"),
        "max_steps": 4,
        "lora_target_linear": True,
        "lora_target_modules": None,
        "lora_modules_to_save": ["embed_tokens", "lm_head"],
        "fsdp": {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]},
    }
    four_bit, eight_bit = QLORA, {"load_in_8bit": True}
    return {
        "reference": {},
        "evaluated": EVALUATED,
        "async": {"async_save": True},
        "merging": {"merge_on_save": True, "save_total_limit": 2},
        "packed": {"sequence_len": 96, "save_steps": None},
        "full-state-dict": {"fsdp": {**fsdp, "state_dict_type": "FULL_STATE_DICT"}},
        "eager-10": UNSAVED_10,
        "compiled-10": {**UNSAVED_10, "torch_compile": True, "torch_compile_backend": "aot_eager"},
        "lora-llama": LORA,
        "lora-qwen": lora_qwen,
        "qlora-llama": {**LORA, **four_bit, "max_steps": 4},
        "qlora-qwen": {**lora_qwen, **four_bit},
        "int8-llama": {**LORA, **eight_bit, "max_steps": 4},
        "int8-qwen": {**lora_qwen, **eight_bit},
        "options": OPTIONS,
    }


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> Run:
    """The run `name` of `_shared_runs`, trained on 2 gloo ranks: all of them once per test run,
    in one launch of 2 processes (`train_configs`), for every module and xdist worker that
    compares with them. Read only: copy a run before changing anything in it.

    The ranks run what a rank of `shardforge train` runs (`run_training`) and log as it does;
    its stderr is rank 0's log. (A launch of ranks costs seconds of imports; torchrun and the
    launcher have the tests of their own that use `launch_train` and `run_train`.)"""
    root = shared_folder(tmp_path_factory, "train-runs", partial(_train_shared, tmp_path_factory))
    run = root / name
    return Run(run / "out", (run / "stderr.txt").read_text(), run / "cfg.yml")


def _train_shared(tmp_path_factory: pytest.TempPathFactory, root: Path) -> None:
    base = shared_base(tmp_path_factory)
    make_model(root / "qwen-base", "qwen2", vocab_size=320, seed=3)
    runs = []
    for name, changes in _shared_runs(base, root).items():
        cfg = {**base, **changes, "output_dir": str(root / name / "out")}
        (root / name).mkdir()
        runs.append(
            (str(write_config(root / name / "cfg.yml", cfg)), str(root / name / "stderr.txt"))
        )
    (root / "stores").mkdir()
    run_on_ranks(train_configs, 2, runs, str(root / "stores"))


def train_configs(rank: int, world: int, runs: list[tuple[str, str | None]], stores: str) -> None:
    """On each rank of `run_on_ranks`: train every config of `runs` (config, log file) in turn,
    as a rank of `shardforge train` does: each run makes and ends its process group; rank 0
    logs at INFO, the others warnings only, to the log file (rank R > 0: `<file>.R`)."""
    import logging

    import torch.distributed as dist

    from shardforge.config import load_cfg
    from shardforge.train.loop import run_training

    logger = logging.getLogger("shardforge")
    for i, (config, log) in enumerate(runs):
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo", init_method=f"file://{stores}/s{i}", rank=rank, world_size=world
            )
        handler = logging.FileHandler(log if rank == 0 else f"{log}.{rank}") if log else None
        if handler is not None:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        try:
            run_training(load_cfg(config, command="train").to_model())
        finally:
            if handler is not None:
                logger.removeHandler(handler)
                handler.close()
    dist.init_process_group("gloo", init_method=f"file://{stores}/end", rank=rank, world_size=world)


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
