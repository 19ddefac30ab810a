"""Trackers: metrics.jsonl, TensorBoard event files and an offline W&B run written by a real
2-rank run (read back with TensorBoard's EventAccumulator and a reader of W&B's record log of our
own), and a resumed run that records every step once."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from train_helpers import read_metrics, train_configs, write_config

from helpers.dist import run_on_ranks
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train import checkpointing as ckpt
from shardforge.train.tracking import (
    TAGS,
    TRACKERS,
    MetricsFile,
    TrackerKind,
    check_trackers,
    open_trackers,
    trim_metrics,
)

# W&B offline, without any network access, quiet, and no slower than it must be
WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_MACHINE_INFO": "true",
}
TRAIN_TAGS = {TAGS[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib")}
EVAL_TAGS = {TAGS["eval_loss"], TAGS["eval_perplexity"]}


def _tracked_cfg(base_cfg: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    return {
        **base_cfg,
        "output_dir": str(out),
        "val_set_size": 0.1,
        "eval_steps": 2,
        "use_tensorboard": True,
        "wandb_project": "shardforge-tests",
        "wandb_name": "tiny",
        "wandb_mode": "offline",
        **extra,
    }


def _stopped_copy(tracked: Path, out: Path) -> None:
    """`tracked` as a run that stopped after logging step 5 (its save of step 6 never
    happened), in `out`: checkpoint-6 gone, metrics.jsonl up to step 5 with step 5's loss
    `STOPPED_LOSS` (what the stopped run logged; the redone step must replace it)."""
    shutil.copytree(tracked, out)
    shutil.rmtree(out / "checkpoint-6")
    before = [m for m in read_metrics(out) if m["step"] <= 5]
    for m in before:
        if m["step"] == 5:
            m["loss"] = STOPPED_LOSS
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in before))


STOPPED_LOSS = -1.0


def _tracked_then_resumed(rank: int, world: int, root: str) -> None:
    """On each of 2 ranks, as a rank of `shardforge train` runs them (`train_configs`, rank 0's
    log in <run>/log.txt): the tracked run; then, once rank 0 has made resumed/out its stopped
    copy and the launcher's checks passed on the resumed config, the resumed run."""
    import torch.distributed as dist

    from shardforge.config import load_cfg
    from shardforge.train.preflight import preflight

    top = Path(root)
    tracked, resumed = top / "tracked", top / "resumed"
    train_configs(rank, world, [(str(tracked / "cfg.yml"), str(tracked / "log.txt"))], root)
    if rank == 0:
        _stopped_copy(tracked / "out", resumed / "out")
        config = str(resumed / "cfg.yml")
        preflight(load_cfg(config, command="train").to_model(), config)
    dist.barrier()  # the resumed run starts from the stopped copy
    dist.destroy_process_group()
    (resumed / "stores").mkdir(exist_ok=True)
    train_configs(
        rank, world, [(str(resumed / "cfg.yml"), str(resumed / "log.txt"))], str(resumed / "stores")
    )


@pytest.fixture(scope="module")
def runs(base_cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of 2 ranks with TensorBoard and offline W&B: tracked/, a run of 6 steps
    evaluating every 2 steps and checkpointing every 2; resumed/, that run stopped after
    logging step 5 (`_stopped_copy`) and resumed (resume_from_checkpoint: auto)."""
    root = tmp_path_factory.mktemp("tracked")
    for run, extra in (("tracked", {}), ("resumed", {"resume_from_checkpoint": "auto"})):
        (root / run).mkdir()
        cfg = _tracked_cfg(base_cfg, root / run / "out", **extra)
        write_config(root / run / "cfg.yml", cfg)
    with pytest.MonkeyPatch.context() as env:  # the ranks' environment
        for key, value in WANDB_ENV.items():
            env.setenv(key, value)
        run_on_ranks(_tracked_then_resumed, 2, str(root))
    return root


@pytest.fixture(scope="module")
def tracked(runs: Path) -> Path:
    return runs / "tracked" / "out"


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header (":W&B", a magic
    number, a version), then LevelDB-style log blocks of 32 KiB, each record a 7-byte header
    (CRC, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def _wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the values logged at it, from the run file of one offline run directory."""
    (run_file,) = run_dir.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.setdefault(int(items["_step"]), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")}
            )
    return history


def _wandb_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)


@pytest.mark.slow  # the fixture's 2 gloo ranks
def test_tensorboard_and_offline_wandb_hold_the_logged_metrics(tracked: Path) -> None:
    rows = read_metrics(tracked)
    train = {m["step"]: m for m in rows if "loss" in m}
    evals = {m["step"]: m for m in rows if "eval_loss" in m}
    assert sorted(train) == [1, 2, 3, 4, 5, 6] and sorted(evals) == [0, 2, 4, 6]
    assert all(m["peak_memory_mib"] > 0 for m in train.values())

    scalars = _scalars(tracked / "runs")
    assert set(scalars) == TRAIN_TAGS | EVAL_TAGS | {TAGS["epoch"]}
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib"):
        logged = scalars[TAGS[key]]
        assert [s for s, _ in logged] == sorted(train)
        for step, value in logged:  # TensorBoard keeps float32
            assert math.isclose(value, train[step][key], rel_tol=1e-6, abs_tol=1e-12), key
    for key in ("eval_loss", "eval_perplexity"):
        logged = scalars[TAGS[key]]
        assert [s for s, _ in logged] == sorted(evals)
        for step, value in logged:
            assert math.isclose(value, evals[step][key], rel_tol=1e-6), key

    (run,) = _wandb_runs(tracked)
    run_id = json.loads((tracked / "tracking.json").read_text())["wandb_run_id"]
    assert run.name.endswith(f"-{run_id}")
    history = _wandb_history(run)
    assert sorted(history) == [0, 1, 2, 3, 4, 5, 6]
    for step, values in history.items():
        want = {
            TAGS[k]: v
            for k, v in {**train.get(step, {}), **evals.get(step, {})}.items()
            if k in TAGS
        }
        assert values == pytest.approx(want, rel=1e-12), step
    assert set(history[2]) == TRAIN_TAGS | EVAL_TAGS | {TAGS["epoch"]}


@pytest.mark.slow  # the fixture's 2 gloo ranks
def test_a_resumed_run_records_every_step_once(runs: Path, tracked: Path) -> None:
    """The run stopped after logging step 5 (its save of step 6 never happened): it resumes
    from checkpoint-4 and redoes steps 5 and 6. metrics.jsonl holds each row once (the redone
    step 5 replaces the one logged before the stop), TensorBoard purges the earlier events of
    steps from 5 on, and W&B, which keeps the steps it has, gets only step 6."""
    out = runs / "resumed" / "out"
    stderr = (runs / "resumed" / "log.txt").read_text()
    assert "checkpoint-4 at step 4" in stderr
    assert "eval at step 0" not in stderr  # only a fresh run evaluates before step 1

    rows = read_metrics(out)
    train = [m["step"] for m in rows if "loss" in m]
    evals = [m["step"] for m in rows if "eval_loss" in m]
    assert train == [1, 2, 3, 4, 5, 6] and evals == [0, 2, 4, 6]
    reference = {m["step"]: m for m in read_metrics(tracked) if "loss" in m}
    for m in rows:
        if "loss" in m:
            assert math.isclose(m["loss"], reference[m["step"]]["loss"], rel_tol=1e-6), m

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = sorted((out / "runs").glob("events.out.tfevents.*"))
    assert len(files) == 2
    starts = [
        e.step
        for e in EventFileLoader(str(files[-1])).Load()
        if e.HasField("session_log") and e.session_log.status == e.session_log.START
    ]
    assert starts == [5]  # purge_step: TensorBoard drops the earlier events of steps >= 5
    scalars = _scalars(out / "runs")
    assert [s for s, _ in scalars[TAGS["loss"]]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars[TAGS["eval_loss"]]] == [0, 2, 4, 6]

    first, second = _wandb_runs(out)
    run_id = json.loads((out / "tracking.json").read_text())["wandb_run_id"]
    for run in (first, second):  # offline-run-<date>_<time>-<id>[-n]: the same W&B run
        assert run.name.split("-")[3] == run_id
    assert sorted(_wandb_history(second)) == [6]
    assert set(_wandb_history(second)[6]) == TRAIN_TAGS | EVAL_TAGS | {TAGS["epoch"]}
    assert ckpt.is_complete(out / "checkpoint-6")


def test_trim_metrics_keeps_the_rows_up_to_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 0, "eval_loss": 3.0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n'
        '{"step": 2, "eval_loss": 1.5}\n{"step": 3, "lo'  # a line cut off by kill -9
    )
    assert trim_metrics(path, 1) == 2
    assert read_metrics(tmp_path) == [{"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.0}]
    assert trim_metrics(tmp_path / "none.jsonl", 4) == 0


def test_a_tracker_that_is_not_installed_is_a_config_error(tmp_path: Path) -> None:
    cfg = validate_cfg({"base_model": "m", "use_tensorboard": True, "output_dir": str(tmp_path)})
    assert check_trackers(cfg) == []  # tensorboard and wandb are installed here
    missing = (
        TRACKERS[0],
        TrackerKind(
            "tensorboard",
            "use_tensorboard",
            "shardforge_no_such_module",
            lambda c: True,
            MetricsFile.open,
        ),
    )
    problems = check_trackers(cfg, missing)
    assert problems == [
        ("use_tensorboard", "tensorboard is not installed; pip install 'shardforge[tracking]'")
    ]
    with pytest.raises(
        ConfigError, match=r"use_tensorboard: .*pip install 'shardforge\[tracking\]'"
    ):
        open_trackers(cfg, tmp_path, True, None, missing)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened
    assert open_trackers(cfg, tmp_path, False, None, missing).trackers == []  # not rank 0


def test_tracking_keys_are_validated_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"wandb_mode: .* is not supported; expected one of 'online', 'offline'"
    ):
        validate_cfg({"base_model": "m", "wandb_mode": "dryrun"})
    with pytest.raises(ConfigError, match=r"use_tensorboard: expected a boolean"):
        validate_cfg({"base_model": "m", "use_tensorboard": "maybe"})
    wanted = {k.name for k in TRACKERS if k.wanted(validate_cfg({"base_model": "m"}))}
    assert wanted == {"metrics.jsonl"}
    off = validate_cfg({"base_model": "m", "wandb_project": "p", "wandb_mode": "disabled"})
    assert {k.name for k in TRACKERS if k.wanted(off)} == {"metrics.jsonl"}
