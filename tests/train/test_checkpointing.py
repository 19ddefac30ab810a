"""Checkpoints: layout, resume (same and other world size), kill -9 mid-save, FULL_STATE_DICT."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import losses, read_metrics, shared_run, train_configs, write_config

from helpers.preloaded import (
    kill_ranks_when,
    run_on_preloaded_ranks,
    start_preloaded_ranks,
    stop_fork_server,
)
from shardforge.errors import CheckpointError
from shardforge.train import checkpointing as ckpt

RTOL = 1e-6  # resumed steps vs uninterrupted steps, fp32 (see test_loop.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run of 6 steps, checkpointing every 2 steps (`shared_run`,
    shared with other modules: read only)."""
    return shared_run(tmp_path_factory, "reference").out


@pytest.fixture(scope="module", autouse=True)
def _fork_server() -> Iterator[None]:
    """The fork server of the tests' gloo ranks (`_train_on_ranks`) ends with this module."""
    yield
    stop_fork_server()


def _train_on_ranks(config: Path, nproc: int) -> str:
    """Train `config` on `nproc` gloo ranks as `shardforge train`'s ranks do (`run_training`,
    `train_configs`), forked from a server that imported the training code once (the launcher
    and torchrun are tested in test_launch.py, test_preflight.py, test_tracking.py); rank 0's
    log."""
    log = config.with_suffix(".log")
    stores = config.parent / f"{config.stem}-stores"
    stores.mkdir()
    run_on_preloaded_ranks(train_configs, nproc, [(str(config), str(log))], str(stores))
    return log.read_text()


def _stopped_after(reference: Path, step: int, dest: Path) -> Path:
    """What output_dir looks like when the reference run stops right after saving `step`."""
    shutil.copytree(reference, dest)
    for path in dest.glob("checkpoint-*"):
        if int(path.name.split("-")[1]) > step:
            shutil.rmtree(path)
    kept = [m for m in read_metrics(dest) if m["step"] <= step]
    (dest / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    return dest


def _assert_same_losses(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for s in steps:
        assert math.isclose(got[s], want[s], rel_tol=RTOL, abs_tol=0.0), (s, got[s], want[s])


def test_layout_matches_the_merge_contract(reference: Path) -> None:
    names = sorted(p.name for p in reference.iterdir())
    assert names == [
        "chat_template.jinja",
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
        "config.json",
        "generation_config.json",
        "metrics.jsonl",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    c6 = reference / "checkpoint-6"
    assert ckpt.is_complete(c6)
    assert sorted(p.name for p in (c6 / "model").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert (c6 / "optimizer" / ".metadata").is_file()
    state = json.loads((c6 / "trainer_state.json").read_text())
    assert state["format"] == "shardforge" and state["format_version"] == 1
    assert state["step"] == 6 and state["world_size"] == 2 and state["consumed"] == 72
    assert state["torch_version"] == torch.__version__
    for rank in (0, 1):
        rng = torch.load(c6 / f"rng_state_{rank}.pt", weights_only=True)
        assert isinstance(rng["torch"], torch.Tensor)


def test_dcp_model_holds_plain_hf_keys_and_the_trained_weights(
    reference: Path, base_cfg: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The DCP model loads into a plain transformers model and equals the FULL_STATE_DICT save
    of the same (deterministic) run, bit for bit; the HF directory loads and generates."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    full = shared_run(tmp_path_factory, "full-state-dict")
    assert full.cfg["fsdp"]["state_dict_type"] == "FULL_STATE_DICT"
    full_out = full.out
    assert not (full_out / "checkpoint-6").exists()  # the final save is the HF directory
    hf = AutoModelForCausalLM.from_pretrained(full_out)

    from_dcp = AutoModelForCausalLM.from_pretrained(base_cfg["base_model"])
    state = from_dcp.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(reference / "checkpoint-6" / "model"), no_dist=True)
    from_dcp.load_state_dict(state)
    base = AutoModelForCausalLM.from_pretrained(base_cfg["base_model"]).state_dict()
    for key, tensor in hf.state_dict().items():
        assert torch.equal(tensor, state[key]), key
        assert not torch.equal(tensor, base[key]), f"{key} was not trained"
    ids = torch.tensor([[5, 17, 42, 9, 100, 7]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, from_dcp(ids).logits)
    assert hf.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 10)


@pytest.mark.parametrize("nproc,micro", [(3, 2)])  # 2 -> 2 is covered by the kill -9 test
def test_resume_continues_like_an_uninterrupted_run(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path, nproc: int, micro: int
) -> None:
    """Stopped after step 4 (at 2 ranks), resumed at `nproc` ranks with the same global batch:
    steps 5 and 6 match the uninterrupted run."""
    out = _stopped_after(reference, 4, tmp_path / "out")
    cfg = {
        **base_cfg,
        "output_dir": str(out),
        "micro_batch_size": micro,
        "resume_from_checkpoint": "auto",
    }
    stderr = _train_on_ranks(write_config(tmp_path / "cfg.yml", cfg), nproc=nproc)
    assert "resumed from" in stderr and "checkpoint-4 at step 4" in stderr
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    _assert_same_losses(got, losses(reference), range(5, 7))
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["world_size"] == nproc and state["step"] == 6


def test_a_trainer_state_is_read_as_untrusted_input(tmp_path: Path) -> None:
    """trainer_state.json nested 200,000 deep, or larger than any trainer state, is one
    CheckpointError naming it (not a RecursionError, not a read of the whole file)."""
    state = tmp_path / ckpt.STATE_FILE
    state.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=r"trainer_state\.json: not valid JSON"):
        ckpt.TrainerState.read(tmp_path)
    state.write_text("[]")
    with pytest.raises(CheckpointError, match="not a shardforge v1 trainer state"):
        ckpt.TrainerState.read(tmp_path)
    with state.open("r+b") as f:
        f.truncate(1 << 30)  # sparse
    with pytest.raises(CheckpointError, match="1,073,741,824 bytes, more than the 16,777,216"):
        ckpt.TrainerState.read(tmp_path)


def test_complete_checkpoints_resolve_and_prune(tmp_path: Path) -> None:
    """Only `checkpoint-<digits>` with trainer_state.json and model/.metadata count."""

    def fake(name: str, state: bool = True, meta: bool = True) -> Path:
        path = tmp_path / name
        (path / "model").mkdir(parents=True)
        if state:
            (path / "trainer_state.json").write_text("{}")
        if meta:
            (path / "model" / ".metadata").write_bytes(b"")
        return path

    fake("checkpoint-2")
    fake("checkpoint-10")
    fake("checkpoint-12.tmp")
    fake("checkpoint-14", state=False)
    fake("checkpoint-16", meta=False)
    fake("checkpoint-x")
    names = [p.name for p in ckpt.complete_checkpoints(tmp_path)]
    assert names == ["checkpoint-2", "checkpoint-10"]  # by step, not by name
    assert ckpt.resolve_resume("auto", tmp_path / "empty") is None
    assert ckpt.resolve_resume(None, tmp_path) is None
    with pytest.raises(CheckpointError, match="every checkpoint"):  # empty files: damaged
        ckpt.resolve_resume("auto", tmp_path, announce=False)
    for bad in ("checkpoint-2", "checkpoint-12.tmp", "checkpoint-14", "nothing"):
        with pytest.raises(CheckpointError, match="resume_from_checkpoint"):
            ckpt.resolve_resume(str(tmp_path / bad), tmp_path)
    assert [p.name for p in ckpt.prune(tmp_path, 1)] == ["checkpoint-2"]
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["checkpoint-10"]
    assert (tmp_path / "checkpoint-12.tmp").exists()  # junk is never pruned as a checkpoint


def test_kill_9_during_save_resumes_from_the_last_complete_checkpoint(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """A real save of step 4 on 2 gloo ranks is killed with SIGKILL (every rank at once) as
    soon as its `checkpoint-4.tmp` appears (the save takes about 200 ms; the test polls every
    millisecond): the next run (2 ranks) resumes from checkpoint-2 and computes what the
    uninterrupted run did. (The ranks are `_train_on_ranks`' : `kill -9` of the `shardforge
    train` command, its torchrun and ranks, is test_launch.py's.)"""
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "cfg.yml",
        {**base_cfg, "output_dir": str(out), "resume_from_checkpoint": "auto"},
    )
    (tmp_path / "stores").mkdir()
    ranks = start_preloaded_ranks(
        train_configs, 2, [(str(config), None)], str(tmp_path / "stores"), store=str(tmp_path)
    )
    saving = out / "checkpoint-4.tmp"
    kill_ranks_when(ranks, saving.exists, "the save of step 4")  # kill -9 of every rank
    assert [rank.exitcode for rank in ranks.processes] == [-signal.SIGKILL] * 2
    assert saving.is_dir()
    assert not (out / "checkpoint-4").exists()
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2"]

    assert "checkpoint-2 at step 2" in _train_on_ranks(config, nproc=2)
    _assert_same_losses(losses(out), losses(reference), range(3, 7))
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert not saving.exists()
    assert os.listdir(out / "checkpoint-4" / "model")


def _truncate(path: Path, keep: float = 0.5) -> None:
    with path.open("r+b") as f:
        f.truncate(int(path.stat().st_size * keep))


def _damage(path: Path) -> None:
    """`path` cut in half, or with `@record` its first record's zip directory overwritten (same
    size: only parsing the record shows it)."""
    if path.name.endswith("@record"):
        path = path.with_name(path.name.removesuffix("@record"))
        data = bytearray(path.read_bytes())
        eocd = data.find(b"PK\x05\x06")
        assert eocd > 0
        data[eocd : eocd + 4] = b"XXXX"
        path.write_bytes(bytes(data))
    else:
        _truncate(path)


@pytest.mark.parametrize(
    "damage,found",
    [
        ("model/__0_0.distcp", "truncated"),
        ("model/__0_0.distcp@record", "model/__0_0.distcp"),
        ("optimizer/.metadata", "optimizer/.metadata"),
        ("rng_state_1.pt", "rng_state_1.pt: unreadable"),
        ("trainer_state.json", "trainer_state.json: not valid JSON"),
    ],
)
def test_a_damaged_checkpoint_is_named_and_auto_falls_back(
    reference: Path, tmp_path: Path, damage: str, found: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The merge's checks (paths, tiling, file sizes) plus the trainer state and RNG files:
    `auto` skips the damaged latest checkpoint with one notice, a named one is one error."""
    out = _stopped_after(reference, 4, tmp_path / "out")
    _damage(out / "checkpoint-4" / damage)
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert ckpt.resolve_resume("auto", out) == out / "checkpoint-2"
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "skipping checkpoint-4, which is damaged" in notices[0]
    assert found in notices[0] and "\n" not in notices[0]
    caplog.clear()
    assert ckpt.resolve_resume("auto", out, announce=False) == out / "checkpoint-2"
    assert not caplog.records
    with pytest.raises(CheckpointError) as err:
        ckpt.resolve_resume(str(out / "checkpoint-4"), out)
    assert "cannot be resumed" in str(err.value) and found in str(err.value)
    assert "\n" not in str(err.value)
    _truncate(out / "checkpoint-2" / "model" / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged"):
        ckpt.resolve_resume("auto", out, announce=False)


def test_resume_falls_back_past_a_damaged_latest_checkpoint(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated data file in the latest checkpoint: training resumes from the previous one
    (one notice) and computes what the uninterrupted run did."""
    out = _stopped_after(reference, 4, tmp_path / "out")
    _truncate(out / "checkpoint-4" / "model" / "__1_0.distcp")
    cfg = _one_rank(base_cfg, out, resume_from_checkpoint="auto")
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, tmp_path / "cfg.yml")
    text = caplog.text
    assert text.count("skipping checkpoint-4, which is damaged") == 1 and "truncated" in text
    assert "checkpoint-2 at step 2" in text
    _assert_same_losses(losses(out), losses(reference), range(3, 7))
    assert ckpt.checkpoint_problem(out / "checkpoint-4") is None  # saved again, complete


def test_a_named_damaged_checkpoint_is_one_error(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    """`shardforge train` on 2 ranks with a damaged checkpoint named explicitly: one error
    line, no traceback, nothing trained. (The command in this process, click's runner: its
    exit status and stderr in a process of its own are tests/cli/test_train_cli.py's.)"""
    from click.testing import CliRunner

    from shardforge.cli.train import command

    out = _stopped_after(reference, 4, tmp_path / "out")
    _truncate(out / "checkpoint-4" / "optimizer" / "__0_0.distcp")
    named = str(out / "checkpoint-4")
    config = write_config(
        tmp_path / "cfg.yml", {**base_cfg, "output_dir": str(out), "resume_from_checkpoint": named}
    )
    result = CliRunner().invoke(command, [str(config), "--nproc_per_node", "2"])
    assert result.exit_code not in (0, None) and not isinstance(result.exception, Exception), (
        result.exception
    )
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert "checkpoint-4 cannot be resumed" in errors[0] and "truncated" in errors[0]
    assert "Traceback" not in result.stderr and not result.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_hsdp_trains_resumes_and_merges_like_full_shard(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """HSDP on 4 ranks (2 replicas x 2 shards) computes the plain 2-rank FULL_SHARD run: same
    losses; its checkpoint resumes without HSDP on 1 rank (in this process) and merges into the
    same weights."""
    from safetensors.torch import load_file

    from shardforge.merge.api import merge_fsdp_weights

    out = tmp_path / "hsdp"
    cfg = {
        **base_cfg,
        "output_dir": str(out),
        "micro_batch_size": 3,  # 3 x 4 ranks x 1 = the reference's global batch of 12
        "gradient_accumulation_steps": 1,
        "dp_shard_size": 2,
        "fsdp": {**base_cfg["fsdp"], "hybrid_shard": True},
    }
    stderr = _train_on_ranks(write_config(tmp_path / "hsdp.yml", cfg), nproc=4)
    assert "HSDP: 2 replicas of 2-rank shard groups" in stderr
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["mesh_shape"] == [2, 2] and state["world_size"] == 4
    assert json.loads((reference / "checkpoint-6" / "trainer_state.json").read_text())[
        "mesh_shape"
    ] == [2]
    _assert_same_losses(losses(out), losses(reference), range(1, 7))

    resumed = _stopped_after(out, 4, tmp_path / "resumed")
    plain = _one_rank(base_cfg, resumed, resume_from_checkpoint="auto")
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(plain, tmp_path / "plain.yml")
    assert "checkpoint-4 at step 4" in caplog.text and "HSDP" not in caplog.text
    _assert_same_losses(losses(resumed), losses(reference), range(5, 7))

    merged = {}
    for name, run in (("hsdp", out), ("reference", reference)):
        path = merge_fsdp_weights(
            {**base_cfg, "output_dir": str(run)}, tmp_path / f"merged-{name}", quiet=True
        )
        merged[name] = load_file(str(path / "model.safetensors"))
    assert merged["hsdp"].keys() == merged["reference"].keys()
    for key, tensor in merged["reference"].items():
        # the gradient reductions differ in order; AdamW's m / (sqrt(v) + eps) enlarges that
        # rounding for weights whose gradients are near 0 (measured up to 3.7e-7 after 6 steps)
        torch.testing.assert_close(merged["hsdp"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def _train_here(cfg: dict[str, Any], config: Path) -> None:
    """`shardforge train CONFIG --launcher python`: one rank in this process (real gloo, DCP)."""
    from shardforge.train.launch import do_train

    assert do_train(write_config(config, cfg), [], "python") == 0


def _one_rank(base_cfg: dict[str, Any], out: Path, **extra: Any) -> dict[str, Any]:
    """The reference's config at 1 rank (the same global batch of 12)."""
    return {**base_cfg, "output_dir": str(out), "micro_batch_size": 6, **extra}


def test_a_larger_max_steps_continues_the_lr_without_a_jump(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resumed after step 4 of 6 with max_steps 10: the lr goes on decaying from where the
    checkpoint was, no higher than before and in steps no larger than the schedule's own."""
    out = _stopped_after(reference, 4, tmp_path / "out")
    cfg = _one_rank(base_cfg, out, max_steps=10, resume_from_checkpoint="auto")
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, tmp_path / "cfg.yml")
    assert "total steps changed (6 -> 10)" in caplog.text
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    lrs = [m["lr"] for m in metrics]
    planned = [m["lr"] for m in read_metrics(reference)]
    assert lrs[:5] == planned[:5]  # the checkpoint's schedule up to its step (and the next lr)
    largest = max(abs(b - a) for a, b in itertools.pairwise(planned))
    after_warmup = lrs[base_cfg["warmup_steps"] :]
    for a, b in itertools.pairwise(lrs):
        assert abs(b - a) <= largest + 1e-12, lrs
    assert all(b <= a for a, b in itertools.pairwise(after_warmup)), lrs
    assert lrs[-1] > 0.0


def test_resuming_a_finished_run(
    reference: Path, base_cfg: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At max_steps: nothing to do, nothing written. Beyond it: the finished cosine schedule
    leaves lr 0, which is said once."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    cfg = _one_rank(base_cfg, out, resume_from_checkpoint="auto")
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here(cfg, tmp_path / "same.yml")
    done = [r.getMessage() for r in caplog.records if "nothing to do" in r.getMessage()]
    assert done == [
        f"nothing to do: {out / 'checkpoint-6'} already reached max_steps=6 (set a larger "
        "max_steps to train further)"
    ]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shardforge"):
        _train_here({**cfg, "max_steps": 8}, tmp_path / "more.yml")
    warned = [m for m in _warnings(caplog) if not m.startswith("notice: sample_packing")]
    assert len(warned) == 1 and "start a new run from the merged weights" in warned[0]
    assert [m["lr"] for m in read_metrics(out)][6:] == [0.0, 0.0]
    assert ckpt.is_complete(out / "checkpoint-8")


def test_saves_per_epoch_sets_the_save_interval(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _one_rank(base_cfg, out, max_steps=5, save_steps=None, saves_per_epoch=3)
    _train_here(cfg, tmp_path / "cfg.yml")
    sequences = round(12 / read_metrics(out)[0]["epoch"])
    every = max(1, math.ceil(sequences / 12) // 3)
    assert every == 2  # 81 sequences: 7 steps per epoch, a checkpoint every 7 // 3 steps
    assert [p.name for p in ckpt.complete_checkpoints(out)] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]


def test_attn_implementations_train(base_cfg: dict[str, Any], tmp_path: Path) -> None:
    """eager and sdpa are the same attention: one step of each gives the same loss."""
    loss = {}
    for impl in ("eager", "sdpa"):
        cfg = _one_rank(base_cfg, tmp_path / impl, max_steps=1, attn_implementation=impl)
        _train_here(cfg, tmp_path / f"{impl}.yml")
        loss[impl] = read_metrics(tmp_path / impl)[0]["loss"]
    assert math.isclose(loss["eager"], loss["sdpa"], rel_tol=1e-5), loss


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
