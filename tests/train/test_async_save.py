"""`async_save: true`: checkpoints written in the background equal synchronous ones, and a job
killed with SIGKILL in the middle of a background save resumes from the last complete one."""

from __future__ import annotations

import json
import logging
import math
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import Run, losses, shared_run, train_configs, write_config

from helpers.preloaded import kill_ranks_when, start_preloaded_ranks, stop_fork_server
from shardforge.formats.dcp.metadata import read_metadata
from shardforge.train import checkpointing as ckpt

RTOL = 1e-6  # resumed vs uninterrupted steps, fp32 (as test_checkpointing.py)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 ranks, 6 steps, a (synchronous) checkpoint every 2 steps (`shared_run`, read only)."""
    return shared_run(tmp_path_factory, "reference")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same with async_save: true (`shared_run`)."""
    run = shared_run(tmp_path_factory, "async")
    assert run.cfg["async_save"] is True
    return run


def _layout(directory: Path) -> dict[str, Any]:
    """What a DCP folder's `.metadata` says about each tensor: dtype, shape and where each
    chunk's bytes are (file name, offset, length)."""
    meta = read_metadata(directory)
    return {
        key: (
            entry.dtype,
            entry.shape,
            [(c.offsets, c.sizes, c.file.name, c.byte_offset, c.byte_length) for c in entry.chunks],
        )
        for key, entry in meta.tensors.items()
    } | {"non-tensor keys": sorted(meta.non_tensor_keys)}


def test_async_checkpoints_equal_sync_ones(sync_run: Run, async_run: Run) -> None:
    """Same losses (bit for bit); the same complete checkpoints: identical shard files (the
    same bytes), the same tensor layout, trainer state and torch RNG states."""
    assert losses(async_run.out) == losses(sync_run.out)
    names = [p.name for p in ckpt.complete_checkpoints(async_run.out)]
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert names == [p.name for p in ckpt.complete_checkpoints(sync_run.out)]
    assert not list(async_run.out.glob("*.tmp"))
    for name in names:
        a, s = async_run.out / name, sync_run.out / name
        assert ckpt.checkpoint_problem(a) is None
        assert json.loads((a / "trainer_state.json").read_text()) == json.loads(
            (s / "trainer_state.json").read_text()
        )
        for sub in ("model", "optimizer"):
            files = sorted(p.name for p in (s / sub).iterdir())
            assert sorted(p.name for p in (a / sub).iterdir()) == files
            for f in files:
                if f != ".metadata":  # .metadata names its own folder
                    assert (a / sub / f).read_bytes() == (s / sub / f).read_bytes(), (name, f)
            assert _layout(a / sub) == _layout(s / sub)
        for rank in (0, 1):
            rng_a = torch.load(a / f"rng_state_{rank}.pt", weights_only=True)
            rng_s = torch.load(s / f"rng_state_{rank}.pt", weights_only=True)
            assert torch.equal(rng_a["torch"], rng_s["torch"])  # python's is seeded per process
    for step in (2, 4, 6):
        assert f"saving checkpoint-{step} in the background" in async_run.stderr
        assert f"saved {async_run.out / f'checkpoint-{step}'} (written in the background" in (
            async_run.stderr
        )


def test_kill_9_during_an_async_save_resumes_from_the_last_complete_checkpoint(
    sync_run: Run, base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The 2 gloo ranks of a run are killed with SIGKILL (every rank at once) while
    checkpoint-4 is being written in the background (its ranks' RNG files exist, the shards
    are being written); with save_total_limit 1 the older checkpoint-2 is still there, and the
    next run (1 rank, in this process) resumes from it and computes what the uninterrupted run
    did. (The ranks run what `shardforge train`'s do, `train_configs`, forked from a server
    that imported the training code once: the command's kill -9 is test_launch.py's.)"""
    from shardforge.train.launch import do_train

    out = tmp_path / "out"
    cfg = {
        **base_cfg,
        "output_dir": str(out),
        "async_save": True,
        "save_total_limit": 1,
        "resume_from_checkpoint": "auto",
    }
    config = write_config(tmp_path / "cfg.yml", cfg)
    (tmp_path / "stores").mkdir()
    ranks = start_preloaded_ranks(
        train_configs, 2, [(str(config), None)], str(tmp_path / "stores"), store=str(tmp_path)
    )
    try:
        saving = out / "checkpoint-4.tmp"
        kill_ranks_when(  # kill -9 of every rank, during the background save of step 4
            ranks,
            lambda: all((saving / f"rng_state_{rank}.pt").exists() for rank in (0, 1)),
            "the save of step 4",
        )
    finally:
        stop_fork_server()
    assert [rank.exitcode for rank in ranks.processes] == [-signal.SIGKILL] * 2
    assert saving.is_dir() and not (out / "checkpoint-4").exists()
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2"]

    resumed = {**cfg, "micro_batch_size": 6}  # the same global batch of 12 on 1 rank
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert do_train(write_config(tmp_path / "one.yml", resumed), [], "python") == 0
    assert "checkpoint-2 at step 2" in caplog.text
    got, want = losses(out), losses(sync_run.out)
    for s in range(3, 7):
        assert math.isclose(got[s], want[s], rel_tol=RTOL, abs_tol=0.0), (s, got[s], want[s])
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-6"]
    assert not saving.exists()
    assert ckpt.checkpoint_problem(out / "checkpoint-6") is None
