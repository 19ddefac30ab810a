"""`shardforge verify DIR [--checkpoint PATH]`: a merged directory against its manifest, and its
checkpoint against the identity recorded there; the first bad file is one `error:` line."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from helpers.keep import make_keep_checkpoint
from helpers.s3 import S3Server
from shardforge.cli.main import cli
from shardforge.merge.api import merge_fsdp_weights
from shardforge.sinks.manifest import MANIFEST, canonical


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint (real DCP) and its merge, sharded in three files."""
    root = tmp_path_factory.mktemp("verify")
    base, ckpt = make_keep_checkpoint(root)
    cfg = {"base_model": str(base), "output_dir": str(root / "run")}
    out = merge_fsdp_weights(
        cfg, root / "merged", checkpoint=ckpt, dtype="bf16", max_shard_size="100KB", quiet=True,
        save_tokenizer=False,
    )  # fmt: skip
    return out, ckpt


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["verify", *(str(a) for a in args)])


def copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def one_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    (line, *_) = result.stderr.splitlines()
    assert line.startswith("error: ") and len(line) <= 300 and "Traceback" not in result.output
    return line


def test_a_good_directory_and_its_checkpoint_pass(merged: tuple[Path, Path]) -> None:
    out, ckpt = merged
    doc = json.loads((out / MANIFEST).read_text())
    assert len([n for n in doc["files"] if n.endswith(".safetensors")]) == 3
    result = run(out, "--checkpoint", ckpt)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ok: {out}: {len(doc['files'])} files, ")
    records = sum(len(f.get("records", [])) for f in doc["source"][0]["files"])
    assert lines[1] == f"ok: {ckpt}: 2 files, {records} records as merged" and records == 23


def test_a_flipped_byte_is_named(merged: tuple[Path, Path], tmp_path: Path) -> None:
    out = copy(merged[0], tmp_path)
    shard = out / "model-00002-of-00003.safetensors"
    flip(shard, shard.stat().st_size // 2)
    line = one_error(run(out))
    assert line == f"error: {shard}: BLAKE3 differs from the manifest (the file changed)"


def old_manifest(out: Path) -> None:
    """Rewrite the manifest of `out` as shardforge wrote it before BLAKE3 (version 1: no
    `hash`, each file's SHA-256, the checksum over the rest)."""
    doc = json.loads((out / MANIFEST).read_text())
    del doc["hash"], doc["checksum"]
    doc["version"] = 1
    for name, entry in doc["files"].items():
        del entry["blake3"]
        entry["sha256"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    doc["checksum"] = hashlib.sha256(canonical(doc)).hexdigest()
    (out / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")


def test_a_manifest_written_the_old_way_still_verifies(
    merged: tuple[Path, Path], tmp_path: Path
) -> None:
    """Version 1 (SHA-256, no `hash`) verifies, and a changed file is named by its SHA-256."""
    out = copy(merged[0], tmp_path)
    old_manifest(out)
    result = run(out, "--checkpoint", merged[1])
    assert result.exit_code == 0, result.output
    shard = out / "model-00003-of-00003.safetensors"
    flip(shard, shard.stat().st_size // 2)
    line = one_error(run(out))
    assert line == f"error: {shard}: SHA-256 differs from the manifest (the file changed)"
    doc = json.loads((out / MANIFEST).read_text())
    doc["version"] = 3
    doc["checksum"] = hashlib.sha256(canonical(doc)).hexdigest()
    (out / MANIFEST).write_text(json.dumps(doc))
    assert "version 3; this shardforge reads versions 1, 2" in one_error(run(out))


def test_a_sha256_manifest_verifies(tmp_path: Path) -> None:
    """`--manifest_hash sha256`: version 2 naming SHA-256; what `sha256sum` prints."""
    base, ckpt = make_keep_checkpoint(tmp_path)
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    out = merge_fsdp_weights(
        cfg, tmp_path / "m", checkpoint=ckpt, quiet=True, save_tokenizer=False,
        manifest_hash="sha256",
    )  # fmt: skip
    doc = json.loads((out / MANIFEST).read_text())
    assert (doc["version"], doc["hash"]) == (2, "sha256")
    data = (out / "model.safetensors").read_bytes()
    assert doc["files"]["model.safetensors"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert run(out, "--checkpoint", ckpt).exit_code == 0


def test_a_missing_or_extra_file_is_named(merged: tuple[Path, Path], tmp_path: Path) -> None:
    out = copy(merged[0], tmp_path)
    (out / "config.json").unlink()
    assert one_error(run(out)) == f"error: {out / 'config.json'}: missing (listed in {MANIFEST})"
    out = copy(merged[0], tmp_path / "extra")
    (out / "notes.txt").write_text("added")
    assert "notes.txt: not written by the merge" in one_error(run(out))
    out = copy(merged[0], tmp_path / "short")
    shard = out / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    size = shard.stat().st_size
    assert (
        one_error(run(out)) == f"error: {shard}: {size:,} bytes, {size + 1:,} when it was written"
    )


def test_a_tampered_or_missing_manifest_is_named(merged: tuple[Path, Path], tmp_path: Path) -> None:
    out = copy(merged[0], tmp_path)
    doc = json.loads((out / MANIFEST).read_text())
    name = "model-00001-of-00003.safetensors"
    doc["files"][name]["blake3"] = "0" * 64  # as if the file's change were hidden
    (out / MANIFEST).write_text(json.dumps(doc))
    line = one_error(run(out))
    assert (
        line
        == f"error: {out / MANIFEST}: changed after it was written (its own checksum does not match)"
    )
    (out / MANIFEST).write_text("{not json")
    assert "not readable as JSON" in one_error(run(out))
    (out / MANIFEST).unlink()
    assert one_error(run(out)).endswith(
        "missing; was this directory written by a shardforge merge?"
    )


def test_a_changed_checkpoint_is_named(merged: tuple[Path, Path], tmp_path: Path) -> None:
    out, ckpt = merged
    moved = copy(ckpt, tmp_path)  # a checkpoint moved since: checked where it is now
    assert run(out, "--checkpoint", moved).exit_code == 0
    data = moved / "__0_0.distcp"
    flip(data, data.stat().st_size // 2)
    line = one_error(run(out, "--checkpoint", moved))
    assert (
        line.startswith(f"error: {data}: record at byte ") and "do not match their CRC-32" in line
    )
    # its data file saved again with other values: the same size, other stored CRC-32s
    _, again = make_keep_checkpoint(tmp_path / "again", seed=1)
    resaved = copy(ckpt, tmp_path / "resaved")
    shutil.copyfile(again / "__0_0.distcp", resaved / "__0_0.distcp")
    assert (resaved / "__0_0.distcp").stat().st_size == (ckpt / "__0_0.distcp").stat().st_size
    line = one_error(run(out, "--checkpoint", resaved))
    assert re.fullmatch(
        rf"error: {re.escape(str(resaved))}/__0_0\.distcp: record at byte [1-9]\d*: "
        r"\S+/data/0 was rewritten \(stored CRC-32 differs\)",
        line,
    ), line
    (moved / ".metadata").unlink()
    assert one_error(run(out, "--checkpoint", moved)) == (
        f"error: {moved / '.metadata'}: missing from the checkpoint the output was merged from"
    )


@pytest.fixture(scope="module")
def run_merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run folder with checkpoint-40 and checkpoint-60 (different weights), the latest merged
    from the run folder."""
    root = tmp_path_factory.mktemp("verify-run")
    base, ckpt = make_keep_checkpoint(root)
    _, other = make_keep_checkpoint(root / "other", seed=1)
    run_dir = root / "run"
    for step, source in ((40, other), (60, ckpt)):  # shardforge's own layout
        shutil.copytree(source, run_dir / f"checkpoint-{step}" / "model")
        (run_dir / f"checkpoint-{step}" / "trainer_state.json").write_text(f'{{"step": {step}}}')
    cfg = {"base_model": str(base), "output_dir": str(run_dir)}
    out = merge_fsdp_weights(cfg, root / "merged", quiet=True, save_tokenizer=False)
    return out, run_dir


def test_a_run_step_or_model_folder_is_the_step_merged(run_merged: tuple[Path, Path]) -> None:
    out, run_dir = run_merged
    model = run_dir / "checkpoint-60" / "model"
    for given in (run_dir, run_dir / "checkpoint-60", model):
        result = run(out, "--checkpoint", given)
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines()[1].startswith(f"ok: {model}: 2 files, ")
    for given in (run_dir / "checkpoint-40", run_dir / "checkpoint-40" / "model"):
        assert one_error(run(out, "--checkpoint", given)) == (
            f"error: {given}: the output was merged from checkpoint-60, not checkpoint-40; "
            "give that checkpoint (or the run folder)"
        )


def test_a_run_folder_without_the_step_merged(
    run_merged: tuple[Path, Path], tmp_path: Path
) -> None:
    out, run_dir = run_merged
    moved = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoint-40", moved / "checkpoint-40")
    assert one_error(run(out, "--checkpoint", moved)) == (
        f"error: {moved}: the output was merged from checkpoint-60, which this folder does not "
        "hold (steps found: [40])"
    )
    shutil.copytree(run_dir / "checkpoint-60", moved / "checkpoint-60")  # moved: still found
    assert run(out, "--checkpoint", moved).exit_code == 0


def test_help_and_the_command_list() -> None:
    result = run("--help")
    assert result.exit_code == 0 and "Examples:" in result.output
    assert "shardforge verify outputs/merged --checkpoint" in result.output
    top = CliRunner().invoke(cli, ["--help"]).output
    assert "verify" in top and "shardforge-manifest.json" in top


@pytest.mark.slow
def test_python_module_entry_point(merged: tuple[Path, Path], tmp_path: Path) -> None:
    out = copy(merged[0], tmp_path)
    cmd = [sys.executable, "-m", "shardforge.cli.verify", str(out)]
    ok = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {out}: "), ok.stderr
    (out / "config.json").write_text("{}")
    bad = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and bad.stderr.startswith(f"error: {out / 'config.json'}: ")


@pytest.mark.slow
def test_a_model_and_its_checkpoint_in_object_storage(
    merged: tuple[Path, Path], s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3:// URIs are read through s3fs (credentials from the AWS variables) and named in
    every line."""
    out, ckpt = merged
    bucket = s3_server.bucket("verify")
    fs = s3_server.fs()
    fs.put(str(out), f"{bucket}/merged", recursive=True)
    fs.put(str(ckpt), f"{bucket}/ckpt", recursive=True)
    for name, value in s3_server.env({}).items():
        monkeypatch.setenv(name, value)
    model, checkpoint = f"s3://{bucket}/merged", f"s3://{bucket}/ckpt"
    result = run(model, "--checkpoint", checkpoint)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"ok: {model}: 5 files, ")
    assert f"ok: {checkpoint}: " in result.stdout
    shard = sorted(p.name for p in out.glob("*.safetensors"))[0]
    original = (out / shard).read_bytes()
    changed = bytearray(original)
    changed[-1] ^= 0x01
    fs.pipe(f"{bucket}/merged/{shard}", bytes(changed))
    line = one_error(run(model))
    assert line == f"error: {model}/{shard}: BLAKE3 differs from the manifest (the file changed)"
    fs.pipe(f"{bucket}/merged/{shard}", original)
    fs.pipe(f"{bucket}/merged/extra.txt", b"x")
    assert one_error(run(model)).startswith(f"error: {model}/extra.txt: not written by the merge")
    assert one_error(run(f"s3://{bucket}/nothing")).endswith(
        "not a directory; give a merged model directory"
    )
