"""The early copy (merge/overlap.py): the bytes start moving before the architecture is built,
and are kept only when they are exactly what the merge writes.

Real checkpoints: tiny models sharded with fully_shard on 2 gloo ranks and saved with dcp.save in
shardforge's and HF Trainer's layouts. Each merge with the early copy is compared byte for byte
with the same merge without it; every bad input must still be refused with nothing left beside
the output path and the checkpoint unchanged, however far the early copy got.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.gate import Gate
from helpers.preloaded import run_on_preloaded_ranks
from helpers.tiny import make_model
from shardforge.errors import CheckpointError, MergeError
from shardforge.layouts.catalog import resolve_checkpoint
from shardforge.merge import overlap
from shardforge.merge.api import merge_fsdp_weights

# the checkpoints are written by gloo ranks
pytestmark = pytest.mark.slow

SHAPES: dict[str, Any] = {
    "vocab_size": 331,
    "hidden_size": 70,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "intermediate_size": 101,
}
# name -> (model_type, dtype): llama is untied, qwen2 ties its embeddings
MODELS = {"llama": ("llama", "float32"), "qwen2": ("qwen2", "bfloat16")}
LAYOUTS = ("shardforge", "hf-trainer")


def save_layouts(rank: int, world_size: int, bases: dict[str, str], root: str) -> None:
    """On every rank: each base model sharded and saved in both layouts under root/<model>/."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    for name, base in bases.items():
        model = AutoModelForCausalLM.from_pretrained(base)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        sd = get_model_state_dict(model)
        ours = Path(root) / name / "shardforge" / "checkpoint-2"
        dcp.save(sd, checkpoint_id=ours / "model")
        if rank == 0:
            state = {"format": "shardforge", "format_version": 1, "step": 2}
            (ours / "trainer_state.json").write_text(json.dumps(state))
        hf = Path(root) / name / "hf-trainer" / "checkpoint-3" / "pytorch_model_fsdp_0"
        dcp.save({"model": sd}, checkpoint_id=hf)


@dataclass(frozen=True)
class Built:
    root: Path
    bases: dict[str, Path]
    other: Path  # llama with another intermediate size: the architecture does not match


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("overlap")
    bases = {
        name: make_model(root / "bases" / name, mt, dtype=dt, seed=i, **SHAPES)
        for i, (name, (mt, dt)) in enumerate(MODELS.items())
    }
    other = make_model(
        root / "bases" / "other", "llama", seed=9, **{**SHAPES, "intermediate_size": 99}
    )
    paths = {k: str(v) for k, v in bases.items()}
    # the ranks start with torch and transformers imported (once, not per rank)
    run_on_preloaded_ranks(save_layouts, 2, paths, str(root / "ckpt"))
    return Built(root, bases, other)


def _cfg(base: Path, output_dir: Path) -> dict[str, Any]:
    return {"base_model": str(base), "output_dir": str(output_dir)}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("early copy")]


def _merge_both_ways(
    cfg: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    **options: Any,
) -> tuple[Path, Path, list[str]]:
    """The merge with the early copy, then without it; (with, without, early-copy log lines).
    (The early copy never creates the output's parent folders: a refused merge creates none.)"""
    tmp_path.mkdir(parents=True, exist_ok=True)
    with caplog.at_level(logging.DEBUG, logger="shardforge"):
        early = merge_fsdp_weights(cfg, tmp_path / "early", quiet=True, **options)
    outcomes = _outcomes(caplog)
    with monkeypatch.context() as m:
        m.setattr(overlap, "ENABLED", False)
        plain = merge_fsdp_weights(cfg, tmp_path / "plain", quiet=True, **options)
    assert not _leftovers(early) and not _leftovers(plain)
    return early, plain, outcomes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", list(MODELS))
def test_the_early_copy_is_used_and_writes_the_same_bytes(
    built: Built,
    model: str,
    layout: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _cfg(built.bases[model], built.root / "ckpt" / model / layout)
    early, plain, outcomes = _merge_both_ways(cfg, tmp_path, monkeypatch, caplog, verify=True)
    assert _files(early) == _files(plain)
    # the bytes save_pretrained wrote for the original model
    assert (early / "model.safetensors").read_bytes() == (
        built.bases[model] / "model.safetensors"
    ).read_bytes()
    assert any(o.startswith("early copy accepted: ") and not o.endswith(": 0 tensors copied")
               for o in outcomes), outcomes  # fmt: skip


def test_sharded_output_and_a_cast(
    built: Built,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several files with an index (every file moved in), and a cast (nothing copied early:
    every byte is converted by the merge itself)."""
    cfg = _cfg(built.bases["llama"], built.root / "ckpt" / "llama" / "hf-trainer")
    early, plain, outcomes = _merge_both_ways(
        cfg, tmp_path / "sharded", monkeypatch, caplog, max_shard_size="60KB"
    )
    assert len([p for p in early.iterdir() if p.suffix == ".safetensors"]) > 2
    assert _files(early) == _files(plain)
    assert any(o.startswith("early copy accepted") for o in outcomes), outcomes
    caplog.clear()
    early, plain, outcomes = _merge_both_ways(
        cfg, tmp_path / "cast", monkeypatch, caplog, dtype="bfloat16", verify=True
    )
    assert _files(early) == _files(plain)
    assert "early copy accepted: 0 tensors copied" in outcomes, outcomes


def test_a_wrong_guess_is_discarded(
    built: Built,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The early plan assumes another default shard size than the installed transformers': the
    copy is removed and the merge writes everything itself."""
    monkeypatch.setattr(overlap, "default_shard_size_guess", lambda: "30KB")
    cfg = _cfg(built.bases["llama"], built.root / "ckpt" / "llama" / "shardforge")
    early, plain, outcomes = _merge_both_ways(cfg, tmp_path, monkeypatch, caplog)
    assert _files(early) == _files(plain)
    assert "early copy discarded: other output files" in outcomes, outcomes


def _copy_checkpoint(built: Built, tmp_path: Path) -> Path:
    src = built.root / "ckpt" / "llama" / "hf-trainer"
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _truncate(run: Path) -> None:
    data = sorted((run / "checkpoint-3" / "pytorch_model_fsdp_0").glob("*.distcp"))[-1]
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/shardforge-overlap-pwned",))


def _malicious_metadata(run: Path) -> None:
    (run / "checkpoint-3" / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(_Evil()))


BAD_INPUTS = {
    "architecture mismatch": (None, MergeError, "does not match the architecture"),
    "truncated data file": (_truncate, CheckpointError, "truncated"),
    "malicious metadata": (_malicious_metadata, CheckpointError, "refused to load"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_with_nothing_left(
    built: Built, case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    damage, error, message = BAD_INPUTS[case]
    run = _copy_checkpoint(built, tmp_path)
    if damage is not None:
        damage(run)
    base = built.other if case == "architecture mismatch" else built.bases["llama"]
    before = tree_hash(run)
    out = tmp_path / "out"
    with caplog.at_level(logging.DEBUG, logger="shardforge"), pytest.raises(error, match=message):
        merge_fsdp_weights(_cfg(base, run), out, quiet=True)
    assert not out.exists() and not _leftovers(out)
    assert tree_hash(run) == before
    assert not Path("/tmp/shardforge-overlap-pwned").exists()


def test_an_output_inside_the_checkpoint_creates_nothing_there(
    built: Built, tmp_path: Path
) -> None:
    """The early copy checks the output path against the checkpoint before it creates its
    hidden directory: nothing appears inside the checkpoint."""
    run = _copy_checkpoint(built, tmp_path)
    model_dir = run / "checkpoint-3" / "pytorch_model_fsdp_0"
    before = tree_hash(run)
    with pytest.raises(MergeError, match="overlaps the checkpoint"):
        merge_fsdp_weights(_cfg(built.bases["llama"], run), model_dir / "merged", quiet=True)
    assert tree_hash(run) == before


def test_the_early_copy_alone_then_discarded_leaves_nothing(built: Built, tmp_path: Path) -> None:
    """An early copy that got all the way (every slab copied into its hidden directory), then
    discarded as a failing merge discards it: the directory is gone."""
    run = built.root / "ckpt" / "llama" / "hf-trainer"
    candidate = resolve_checkpoint(run, None, None)
    out = tmp_path / "out"
    with overlap.early_copy(candidate, str(built.bases["llama"]), out, False, "config", None) as e:
        assert e is not None
        e._thread.join()
        assert e.outcome == "copied", e.outcome
        assert e.directory is not None and len(e.copied) > 10
        assert _leftovers(out) == [e.directory.name]
    assert not _leftovers(out) and not out.exists()


def test_an_early_copy_discarded_before_its_thread_runs(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned but not started (an interrupt came first), or started with its thread never
    running (an interrupt inside `Thread.start`): `discard` returns at once, or after its
    bounded wait, and nothing is left."""
    run = built.root / "ckpt" / "llama" / "hf-trainer"
    out = tmp_path / "out"
    target = overlap.CopyTarget(
        resolve_checkpoint(run, None, None), str(built.bases["llama"]), out, False, "config", None
    )
    early = overlap.EarlyCopy(target)
    assert early.planned is not None and not early.started
    early.discard()
    monkeypatch.setattr(overlap, "START_WAIT_S", 0.05)
    never = overlap.EarlyCopy(target)
    never.started = True  # as if `Thread.start` was interrupted before the thread existed
    t0 = time.monotonic()
    never.discard()
    assert time.monotonic() - t0 < 5
    assert not _leftovers(out) and not out.exists()


def test_sigterm_while_starting_up_leaves_nothing(built: Built, tmp_path: Path) -> None:
    """SIGTERM once the early copy's hidden directory exists (the merge is still starting up):
    the command stops, nothing is left beside the output path. The merge's main thread pauses
    right after starting the early copy's thread (a test gate on `Thread.start`), so the
    signal always comes before the merge could take the copy over."""
    run = built.root / "ckpt" / "llama" / "hf-trainer"
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump(_cfg(built.bases["llama"], run)))
    out = tmp_path / "out"
    gate = Gate(tmp_path / "gate", "threading:Thread.start", "shardforge-early")
    cmd = [sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(cfg),
           "--output_path", str(out), "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=gate.env())
    try:
        gate.wait(proc)
        deadline = time.monotonic() + 120  # only a bound on a hang: the merge is paused
        while not _leftovers(out):  # the early copy's thread creates its hidden directory
            assert time.monotonic() < deadline and proc.poll() is None, "no early copy began"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, err
    assert "error: interrupted" in err and "Traceback" not in err, err
    assert not out.exists() and not _leftovers(out), err


# A merge run as the command line runs it: the head start entered before torch is imported.
HEAD_START_SCRIPT = r"""
import json, sys
from pathlib import Path
from shardforge.config import load_cfg
from shardforge.merge import overlap
cfg = load_cfg(sys.argv[1], command="merge")
out = Path(sys.argv[2])
report = {}
with overlap.head_start(cfg, out, {"quiet": True}):
    early = overlap._HEAD_START[0] if overlap._HEAD_START else None
    report["torch imported"] = "torch" in sys.modules
    if early is not None and early.planned is not None:
        report["dtypes"] = sorted({type(t.spec.dtype).__name__ for _, t in early.planned.tensors()})
    from shardforge.merge.api import merge_fsdp_weights
    try:
        merge_fsdp_weights(cfg, out, quiet=True)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["outcome"] = early.outcome if early is not None else None
print(json.dumps(report))
"""


@pytest.mark.parametrize("case", ["qwen2", "llama", "malicious metadata", "architecture mismatch"])
def test_the_head_start_copies_before_torch_is_imported(
    built: Built, case: str, tmp_path: Path
) -> None:
    """In a fresh interpreter, as `shardforge merge-sharded-fsdp-weights` runs: the checkpoint's
    metadata is read and the copy started with no torch imported (its dtypes are `DtypeName`s),
    the merge takes the copy over and writes save_pretrained's bytes; a bad input is refused
    with nothing left beside the output and the checkpoint unchanged (the hostile pickle is
    refused by the head start's reader too: nothing runs)."""
    model = "qwen2" if case == "qwen2" else "llama"
    run = _copy_checkpoint(built, tmp_path) if model == "llama" else (
        built.root / "ckpt" / "qwen2" / "hf-trainer")  # fmt: skip
    if case == "malicious metadata":
        _malicious_metadata(run)
    base = built.other if case == "architecture mismatch" else built.bases[model]
    cfg = tmp_path / "cfg.yml"
    cfg.write_text(yaml.safe_dump(_cfg(base, run)))
    before = tree_hash(run)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", HEAD_START_SCRIPT, str(cfg), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["torch imported"] is False
    assert tree_hash(run) == before
    assert not _leftovers(out)
    if case in ("qwen2", "llama"):
        assert report["dtypes"] == ["DtypeName"] and "error" not in report, report
        assert report["outcome"] == "accepted", report
        assert (out / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    elif case == "malicious metadata":
        assert "refused to load" in report["error"], report
        assert report["outcome"].startswith("gave up: ") and "refused" in report["outcome"]
        assert not Path("/tmp/shardforge-overlap-pwned").exists()
        assert not out.exists()
    else:
        assert "does not match the architecture" in report["error"], report
        assert report["outcome"].startswith("copied"), report  # it got all the way
        assert not out.exists()


def test_a_head_start_for_another_merge_is_not_used(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The head start was started for a cast, the merge asks for none: it starts its own
    early copy, and the head start's directory is removed."""
    cfg = overlap.ShardforgeConfig.model_validate(
        _cfg(built.bases["llama"], built.root / "ckpt" / "llama" / "hf-trainer")
    )
    out = tmp_path / "out"
    with overlap.head_start(cfg, out, {"dtype": "bfloat16", "quiet": True}):
        started = overlap._HEAD_START[0]
        assert started.target.dtype == "bfloat16"
        with caplog.at_level(logging.DEBUG, logger="shardforge"):
            merge_fsdp_weights(cfg, out, quiet=True)
        assert started.directory is None and not overlap._HEAD_START
    outcomes = _outcomes(caplog)
    assert any(o.startswith("early copy accepted: ") for o in outcomes), outcomes
    assert not _leftovers(out)
    assert (out / "model.safetensors").read_bytes() == (
        built.bases["llama"] / "model.safetensors"
    ).read_bytes()


def test_one_merge_scans_once_and_parses_each_file_once(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the command line merges (head start, then the merge taking it over, removal planned):
    the run folder is scanned once, `.metadata` parsed once and every record once, although
    the head start, the merge, the removal plan and the writer all ask for them."""
    from shardforge.formats.dcp import chunks, metadata
    from shardforge.layouts import catalog

    run = _copy_checkpoint(built, tmp_path)
    scans: list[Path] = []
    reads: list[Path] = []
    records: list[tuple[str, int, int]] = []
    real_scan, real_read, real_parse = catalog._scan, metadata._read, chunks.parse_record

    def scan(root: Path, dirname: str | None) -> Any:
        scans.append(root)
        return real_scan(root, dirname)

    def read(d: Path, meta_path: Path) -> Any:
        reads.append(meta_path)
        return real_read(d, meta_path)

    def parse(file: Path, fd: int, offset: int, length: int) -> Any:
        records.append((file.name, offset, length))
        return real_parse(file, fd, offset, length)

    monkeypatch.setattr(catalog, "_scan", scan)
    monkeypatch.setattr(metadata, "_read", read)
    monkeypatch.setattr(chunks, "parse_record", parse)
    cfg = overlap.ShardforgeConfig.model_validate(_cfg(built.bases["llama"], run))
    out = tmp_path / "out"
    options = {"quiet": True, "remove_checkpoint_dir": True}
    with overlap.head_start(cfg, out, options):
        assert overlap._HEAD_START, "the head start did not start"
        merge_fsdp_weights(cfg, out, **options)
    assert (out / "model.safetensors").read_bytes() == (
        built.bases["llama"] / "model.safetensors"
    ).read_bytes()
    assert scans == [run]
    assert len(reads) == 1
    assert records and len(records) == len(set(records)), sorted(records)
