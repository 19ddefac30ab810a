"""Lightning's meta.pt (`shardforge.formats.lightning_meta`): what Lightning writes beside a
sharded checkpoint reads through the allow-list unpickler (no torch.load); a hostile one is
refused without running its payload, and the step scan and `inspect` then know nothing of it,
as before."""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.hostile import Reduce, check_refusal, refuses_the_corpus
from shardforge.errors import CheckpointError
from shardforge.formats.lightning_meta import LIGHTNING_META, read_lightning_meta
from shardforge.formats.torchsave import LocalTensor
from shardforge.inspection import _lightning_versions
from shardforge.layouts.layout import lightning_step

CALLBACK = (
    "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
    "'every_n_epochs': 1, 'train_time_interval': None}"
)


def lightning_meta(step: int) -> dict[str, Any]:
    """What Lightning's FSDP strategy saves to meta.pt: its checkpoint dict without the model
    and optimizer states (loops, callbacks, schedulers, hyper-parameters, versions)."""
    progress = {"ready": step, "started": step, "processed": step, "completed": step}
    return {
        "epoch": 1,
        "global_step": step,
        "pytorch-lightning_version": "2.5.0",
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": step},
                "epoch_progress": {"total": dict(progress), "current": dict(progress)},
            },
            "validate_loop": {"state_dict": {}, "batch_progress": {"total": progress}},
        },
        "callbacks": {
            CALLBACK: {
                "monitor": "val_loss",
                "best_model_score": torch.tensor(0.25),
                "best_model_path": f"/runs/epoch=1-step={step}.ckpt",
                "current_score": torch.tensor(0.25),
                "best_k_models": {f"/runs/epoch=1-step={step}.ckpt": torch.tensor(0.25)},
                "kth_value": torch.tensor(math.inf),
                "dirpath": "/runs",
                "last_model_path": "",
            },
        },
        "lr_schedulers": [
            {"base_lrs": [1e-3], "last_epoch": step, "_last_lr": [1e-3], "lr_lambdas": [None]}
        ],
        "hparams_name": "kwargs",
        "hyper_parameters": OrderedDict(lr=1e-3, layers=2, name="tiny", warmup=None),
    }


def test_a_real_meta_pt_reads_without_torch_load(tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    written = lightning_meta(12)
    torch.save(written, path)
    meta = read_lightning_meta(path)
    assert (meta["global_step"], meta["epoch"], meta["pytorch-lightning_version"]) == (
        12,
        1,
        "2.5.0",
    )
    assert meta["loops"] == written["loops"] and meta["lr_schedulers"] == written["lr_schedulers"]
    assert meta["hyper_parameters"] == written["hyper_parameters"]
    kth = meta["callbacks"][CALLBACK]["kth_value"]  # described, its bytes never read
    assert isinstance(kth, LocalTensor) and kth.size == () and kth.storage.dtype == torch.float32
    assert lightning_step(path) == 12
    assert _lightning_versions(tmp_path) == {"pytorch-lightning": "2.5.0"}


def test_a_hostile_meta_pt_is_refused_without_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "meta.pt"
    hostile = {**lightning_meta(7), "x": Reduce(os.system, f"touch {marker}")}
    torch.save(hostile, path)
    with pytest.raises(CheckpointError) as info:
        read_lightning_meta(path)
    message = str(info.value)
    check_refusal(message, "os.system")
    assert message.startswith(f"{path}: refused to load: the pickle references posix.system")
    assert "not on the allow-list for Lightning meta.pt files" in message
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert lightning_step(path) == -1  # the step is unknown, as with torch.load before
        assert _lightning_versions(tmp_path) == {}
    logged = [r.getMessage() for r in caplog.records]
    message = message.removeprefix(f"{path}: ")
    assert logged == [
        f"{path}: not read ({message}); step unknown",
        f"{path}: not read ({message})",
    ]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: torch.save([1, 2], p), "holds a list, not Lightning's metadata dict"),
        (lambda p: p.write_bytes(b""), "meta.pt"),
        (lambda p: torch.save({"w": torch.nn.Linear(1, 1)}, p), "not on the allow-list"),
    ],
)
def test_what_is_not_a_meta_pt(write: Any, message: str, tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    write(path)
    with pytest.raises(CheckpointError, match=message) as info:
        read_lightning_meta(path)
    check_refusal(str(info.value), message)
    assert lightning_step(path) == -1


def test_meta_profile_refuses_the_corpus(tmp_path: Path) -> None:
    refuses_the_corpus(LIGHTNING_META, tmp_path)
