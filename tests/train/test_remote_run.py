"""Training with output_dir in object storage (the loopback SeaweedFS): checkpoints written by
DCP's fsspec writer, complete only with their trainer_state.json; resumed from the store at
another world size with the losses of a local run; the stored checkpoint merges into the local
one's weights; settings a stored output_dir cannot serve are refused before any rank starts."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import losses, shared_run, train_configs, write_config

from helpers.preloaded import run_on_preloaded_ranks, stop_fork_server
from helpers.s3 import S3Server
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.merge.api import merge_fsdp_weights
from shardforge.train.launch import do_train
from shardforge.train.preflight import check_output, check_resume, preflight
from shardforge.train.remote_run import RemoteOutput, RunFiles

# torchrun ranks and the store are child processes
pytestmark = pytest.mark.slow

RTOL = 1e-6  # resumed steps vs uninterrupted steps, fp32 (as test_checkpointing.py)


def stored_losses(server: S3Server, prefix: str) -> dict[int, float]:
    rows = server.fs().cat_file(f"{prefix}/metrics.jsonl").decode().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows) if r.get("loss") is not None}


def keys(server: S3Server, prefix: str) -> set[str]:
    fs = server.fs()
    fs.invalidate_cache()
    return {k[len(prefix) + 1 :] for k in fs.find(prefix)}


def test_train_saves_to_s3_and_resumes_at_another_world_size(
    base_cfg: dict[str, Any],
    s3_server: S3Server,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same config trained to the store as the shared local reference run (2 gloo ranks
    running what `shardforge train`'s do, `train_configs`, forked from a server that imported
    the training code once), then resumed on 1 rank in this process (`--launcher python`); the
    credentials and endpoint come from the AWS variables."""
    bucket = s3_server.bucket("train-run")
    prefix = f"{bucket}/run"
    env = s3_server.env({})  # credentials and endpoint from the AWS variables
    local = shared_run(tmp_path_factory, "reference").out  # read only
    for name, value in env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    (tmp_path / "stores").mkdir()
    config = write_config(tmp_path / "s3.yml", {**base_cfg, "output_dir": f"s3://{prefix}"})
    stop_fork_server()  # a new one, with the AWS variables
    try:
        run_on_preloaded_ranks(train_configs, 2, [(str(config), None)], str(tmp_path / "stores"))
    finally:
        stop_fork_server()
    stored = keys(s3_server, prefix)
    for step in (2, 4, 6):
        for name in ("trainer_state.json", "model/.metadata", "optimizer/.metadata"):
            assert f"checkpoint-{step}/{name}" in stored
        assert {f"checkpoint-{step}/rng_state_{r}.pt" for r in (0, 1)} <= stored
    assert {"config.json", "tokenizer.json", "metrics.jsonl"} <= stored
    want = losses(local)
    assert stored_losses(s3_server, prefix) == pytest.approx(want, rel=RTOL, abs=0.0)

    # the stored checkpoint merges into the weights of the local one
    merged = {}
    for name, ckpt in (("s3", f"s3://{prefix}/checkpoint-4"), ("local", local / "checkpoint-4")):
        cfg = {**base_cfg, "output_dir": str(local), "storage_options": s3_server.storage_options}
        out = merge_fsdp_weights(cfg, tmp_path / f"merged-{name}", checkpoint=ckpt, quiet=True)
        merged[name] = load_file(str(out / "model.safetensors"))
    assert merged["s3"].keys() == merged["local"].keys()
    for key, tensor in merged["local"].items():
        assert torch.equal(merged["s3"][key], tensor), key

    # checkpoint-6 without its marker is incomplete: resume (1 rank, the same global batch of
    # 12) takes checkpoint-4 and trains steps 5 and 6 as the local run did
    s3_server.fs().rm_file(f"{prefix}/checkpoint-6/trainer_state.json")
    resumed = {
        **base_cfg,
        "output_dir": f"s3://{prefix}",
        "micro_batch_size": 6,
        "resume_from_checkpoint": "auto",
        "save_total_limit": 2,
    }
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert do_train(write_config(tmp_path / "resume.yml", resumed), [], "python") == 0
    assert f"resumed from s3://{prefix}/checkpoint-4 at step 4" in caplog.text, caplog.text[-3000:]
    got = stored_losses(s3_server, prefix)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert math.isclose(got[step], want[step], rel_tol=RTOL, abs_tol=0.0), step
    stored = keys(s3_server, prefix)
    state = json.loads(s3_server.fs().cat_file(f"{prefix}/checkpoint-6/trainer_state.json"))
    assert state["world_size"] == 1 and state["step"] == 6
    # save_total_limit 2: checkpoint-2 is removed from the store, marker and all
    assert not any(k.startswith("checkpoint-2/") for k in stored)
    assert {"checkpoint-4/trainer_state.json", "checkpoint-6/model/.metadata"} <= stored


def test_unsupported_settings_and_stored_outputs_are_refused(
    base_cfg: dict[str, Any], s3_server: S3Server, tmp_path: Path
) -> None:
    bucket = s3_server.bucket("train-refused")
    options = s3_server.storage_options
    cfg = ShardforgeConfig.model_validate(
        {
            **base_cfg,
            "output_dir": f"s3://{bucket}/run",
            "storage_options": options,
            "merge_on_save": True,
            "async_save": True,
        }
    )
    found = dict(check_resume(cfg))
    assert "not supported with an s3:// output_dir" in found["merge_on_save"]
    assert "async_save" in found and check_output(cfg) == []
    # a fresh run into a prefix that holds a saved model or a checkpoint
    files = RunFiles(RemoteOutput.of(cfg), tmp_path / "files")  # type: ignore[arg-type]
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "model.safetensors").write_bytes(b"x")
    files.sync()
    plain = cfg.model_copy(update={"merge_on_save": False, "async_save": False})
    with pytest.raises(ConfigError) as err:
        preflight(plain)
    assert "already holds a saved model (model.safetensors)" in str(err.value)
    # an index comes after the files it lists; a file removed here goes from the store
    (tmp_path / "files" / "model.safetensors").unlink()
    (tmp_path / "files" / "w.safetensors").write_bytes(b"w")
    (tmp_path / "files" / "model.safetensors.index.json").write_text("{}")
    files.sync()
    assert keys(s3_server, f"{bucket}/run") == {"w.safetensors", "model.safetensors.index.json"}
    wrong = plain.model_copy(update={"output_dir": "s3://no-such-bucket/run"})
    assert "no such bucket" in dict(check_resume(wrong))["output_dir"]
