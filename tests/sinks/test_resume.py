"""`--resume` of a local merge: a merge killed with SIGKILL leaves its hidden directory and
journal; the resumed merge keeps each finished file whose size and SHA-256 still match (the same
inode: not rewritten), rewrites a damaged one, and publishes what a merge in one go writes. A
checkpoint replaced since by another save of the same shapes (local, or in a store) is refused,
naming what changed: the fingerprint holds the inputs' identities and content, not their names."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers.gate import Gate
from helpers.s3 import S3Server, tree_bytes
from helpers.saves import Saves, shared_saves
from helpers.zygote import Zygote, killed_at, zygote_fixture
from shardforge.errors import MergeError
from shardforge.merge.api import merge_fsdp_weights
from shardforge.sinks.resume import JOURNAL_NAME
from test_inspection import HF_STEP, Built, build_checkpoints

# gloo ranks write the checkpoint; the merge that is killed is a child process
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Saves:
    return shared_saves(tmp_path_factory)  # written once per run (tests/sinks, tests/io)


@pytest.fixture(scope="module")
def warm(request: pytest.FixtureRequest) -> Iterator[Zygote]:
    """The merges a test stops, signals or kills: forked from a process that has imported
    the merge once (`helpers.zygote`), not a new interpreter each."""
    yield from zygote_fixture(request)


# each save of the journal of a local merge (its first: the empty one; each later one, on the
# journal's thread, adds one finished file, whose hash is done)
JOURNAL_SAVED = r"/\.out\.tmp-[^/]+/" + re.escape(Path(JOURNAL_NAME).with_suffix(".tmp").name) + "$"
JOURNAL_THREAD = "^shardforge-journal"


def test_a_killed_merge_resumes_keeping_its_finished_files(
    checkpoints: Built, tmp_path: Path, warm: Zygote
) -> None:
    """... also once the checkpoint is a copy of the one it read (new inode numbers, as after a
    copy or a remount; the same content, sizes and mtimes)."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(checkpoints.root / f"hf/checkpoint-{HF_STEP}/pytorch_model_fsdp_0", folder)
    config = {"base_model": str(checkpoints.base), "output_dir": "unused"}
    whole = merge_fsdp_weights(
        config, tmp_path / "whole", checkpoint=folder, max_shard_size="150KB"
    )
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    # stopped once the journal holds two finished files (each save on the journal's thread adds
    # one file, whose hash is done): not at a moment that races hashing
    gate = Gate(tmp_path / "gate", "os:replace", JOURNAL_SAVED, thread=JOURNAL_THREAD, nth=2)
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", str(out), "--checkpoint", str(folder), "--max_shard_size", "150KB",
        "--quiet",
    ]  # fmt: skip
    killed_at(warm, gate, cmd, gate.env())
    assert not out.exists()
    (hidden,) = tmp_path.glob(".out.tmp-*")
    finished = json.loads((hidden / JOURNAL_NAME).read_text())["files"]
    assert len(finished) >= 2
    first, second = sorted(finished)[:2]
    inode = (hidden / first).stat().st_ino
    with (hidden / second).open("r+b") as f:  # damaged since: must be written again
        f.seek(-1, 2)
        f.write(b"\x7f")
    inodes = {p.name: p.stat().st_ino for p in folder.iterdir()}
    shutil.copytree(folder, tmp_path / "copy")  # copy2: mtimes kept, inodes new
    shutil.rmtree(folder)
    (tmp_path / "copy").rename(folder)
    assert all(p.stat().st_ino != inodes[p.name] for p in folder.iterdir())
    merge_fsdp_weights(
        config, out, checkpoint=folder, max_shard_size="150KB", resume=True, verify=True
    )
    assert tree_bytes(out) == tree_bytes(whole)
    assert (out / first).stat().st_ino == inode  # kept, not rewritten
    assert not (out / JOURNAL_NAME).exists() and not list(tmp_path.glob(".out.*"))


def test_resume_of_another_plan_is_refused(checkpoints: Built, tmp_path: Path) -> None:
    from shardforge.sinks.plan import OutputPlan
    from shardforge.sinks.resume import LocalJournal, fingerprint

    plan = OutputPlan([], None)
    LocalJournal(tmp_path, fingerprint(plan, {"a": {}}), resume=False)
    with pytest.raises(MergeError, match=r"--resume refused: .*\n.*a was read by the interrupted"):
        LocalJournal(tmp_path, fingerprint(plan, {"b": {}}), resume=True)
    journal = tmp_path / JOURNAL_NAME
    journal.write_text(json.dumps({"fingerprint": "0" * 64, "files": {}}))  # an older journal
    with pytest.raises(MergeError, match="--resume refused: the interrupted merge planned other"):
        LocalJournal(tmp_path, fingerprint(plan, {"b": {}}), resume=True)


def test_resume_over_a_checkpoint_replaced_by_another_save_is_refused(
    saves: Saves, tmp_path: Path, warm: Zygote
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(saves.a, ck)
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(saves.config()))
    out = tmp_path / "out"
    gate = Gate(tmp_path / "gate", "os:replace", JOURNAL_SAVED, thread=JOURNAL_THREAD, nth=2)
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", str(out), "--checkpoint", str(ck), "--max_shard_size", "1MB", "--quiet",
    ]  # fmt: skip
    killed_at(warm, gate, cmd, gate.env())
    (hidden,) = tmp_path.glob(".out.tmp-*")
    assert len(json.loads((hidden / JOURNAL_NAME).read_text())["files"]) >= 2
    shutil.rmtree(ck)
    shutil.copytree(saves.b, ck)  # the same names, shapes and sizes; other tensors
    with pytest.raises(MergeError, match="--resume refused: ") as err:
        merge_fsdp_weights(saves.config(), out, checkpoint=ck, max_shard_size="1MB", resume=True)
    text = str(err.value)
    for name in (".metadata", "__0_0.distcp"):
        assert f"{ck / name} changed since the interrupted merge read it" in text, text
    assert "its content differs" in text and "mtime" in text, text
    assert "its finished files are kept" in text, text
    assert not out.exists()  # nothing published
    (kept,) = tmp_path.glob(".out.tmp-*")  # with its finished files, for a later --resume
    assert len(json.loads((kept / JOURNAL_NAME).read_text())["files"]) >= 2


def _upload(server: S3Server, folder: Path, prefix: str) -> None:
    """Every file of `folder` put under `prefix` (replacing an object of the same name)."""
    fs = server.fs()
    for path in sorted(folder.iterdir()):
        fs.put_file(str(path), f"{prefix}/{path.name}")


def test_resume_over_a_replaced_checkpoint_in_a_store_is_refused(
    saves: Saves, s3_server: S3Server, tmp_path: Path, warm: Zygote
) -> None:
    bucket = s3_server.bucket("resume-replaced")
    _upload(s3_server, saves.a, f"{bucket}/ck")
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(saves.config()))
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", f"s3://{bucket}/model", "--checkpoint", f"s3://{bucket}/ck",
        "--max_shard_size", "1MB", "--quiet",
    ]  # fmt: skip
    # killed once the second file is being staged (its journal beside the prefix)
    gate = Gate(tmp_path / "gate", "os:pwrite", r"/output-[^/]+/model-00002-of-\d+", thread=".")
    killed_at(warm, gate, cmd, gate.env(s3_server.env()))
    _upload(s3_server, saves.b, f"{bucket}/ck")  # another save of the same shapes
    config = saves.config(storage_options=s3_server.storage_options)
    with pytest.raises(MergeError, match="--resume refused: ") as err:
        merge_fsdp_weights(
            config,
            f"s3://{bucket}/model",
            checkpoint=f"s3://{bucket}/ck",
            max_shard_size="1MB",
            resume=True,
        )
    text = str(err.value)
    changed = f"s3://{bucket}/ck/__0_0.distcp changed since the interrupted merge read it: ETag"
    assert changed in text and "shardforge-staging" not in text, text
    assert s3_server.fs().find(f"{bucket}/model") == []  # nothing published
