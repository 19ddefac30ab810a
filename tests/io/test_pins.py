"""Inputs pinned from the plan to the last byte (`io.pins`): a checkpoint file replaced by another
save of the same shapes once the merge has planned (local: another inode; in a store: another
ETag, while the merge reads it by ranged GETs) is one `error:` line naming it, and nothing is
published. The merges that are paused and changed under are child processes (`helpers.gate`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.gate import Gate
from helpers.s3 import S3Server
from helpers.saves import Saves, change_after_plan, replace_files, rewrite_in_place, shared_saves
from helpers.zygote import Zygote, zygote_fixture
from shardforge.errors import CheckpointError
from shardforge.io.files import open_regular
from shardforge.io.pins import check_all, check_and_release, pin, pin_session
from shardforge.sinks.resume import JOURNAL_NAME

# the journal's first save: the plan is made and every input pinned, no tensor written yet
JOURNAL_SAVED = r"/\.out\.tmp-[^/]+/" + re.escape(Path(JOURNAL_NAME).with_suffix(".tmp").name) + "$"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Saves:
    return shared_saves(tmp_path_factory)  # written once per run (tests/sinks, tests/io)


@pytest.fixture(scope="module")
def warm(request: pytest.FixtureRequest) -> Iterator[Zygote]:
    """The merges a test stops, signals or kills: forked from a process that has imported
    the merge once (`helpers.zygote`), not a new interpreter each."""
    yield from zygote_fixture(request)


def test_a_file_changed_after_its_pin_is_refused_at_open_and_before_publishing(
    tmp_path: Path,
) -> None:
    data = tmp_path / "ck" / "__0_0.distcp"
    data.parent.mkdir()
    data.write_bytes(b"a" * 100)
    outside = tmp_path / "other"
    outside.write_bytes(b"o")
    with pin_session():
        os.close(open_regular(data))  # first seen here: the pin is this identity
        replace = tmp_path / "new"
        replace.write_bytes(b"b" * 100)  # the same size, other bytes, another inode
        os.replace(replace, data)
        with pytest.raises(CheckpointError, match=r"__0_0\.distcp: changed while the merge read"):
            pin(data)  # the plan is made after the change: refused
    with pin_session():
        pinned = pin(data)
        os.close(open_regular(data))  # unchanged: fine
        os.close(open_regular(outside))  # not an input: never checked
        outside.write_bytes(b"changed")
        check_all()
        os.utime(data, ns=(1, 1))  # rewritten in place: the same inode, another mtime
        with pytest.raises(CheckpointError, match=r"mtime \(ns\) \d+ -> 1"):
            open_regular(data)
        with pytest.raises(CheckpointError, match="changed while the merge read it"):
            check_all()
    assert pinned.describe()["inode"] == data.stat().st_ino
    check_all()  # outside a session: nothing is pinned
    with pin_session():
        pin(data)
        check_and_release()  # about to publish: the next merge of the session pins its own
        os.utime(data, ns=(2, 2))
        os.close(open_regular(data))
        check_all()


def _merge_changed_under(
    warm: Zygote, cmd: list[str], gate: Gate, env: dict[str, str], change: object
) -> subprocess.CompletedProcess[str]:
    """Run the merge `cmd` until it waits at `gate`, call `change()`, let it go on."""
    proc = warm.popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        gate.wait(proc)
        change()  # type: ignore[operator]
    finally:
        gate.open()
    _, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", stderr)


def _refused(done: subprocess.CompletedProcess[str], name: str) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert name in errors[0] and "changed while the merge read it" in errors[0], errors
    return errors[0]


@pytest.mark.slow
def test_a_checkpoint_file_replaced_after_the_plan_is_refused(
    saves: Saves, tmp_path: Path, warm: Zygote
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(saves.a, ck)
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(saves.config()))
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", str(out), "--checkpoint", str(ck), "--max_shard_size", "1MB", "--quiet",
    ]  # fmt: skip
    gate = Gate(tmp_path / "gate", "os:replace", JOURNAL_SAVED)
    done = _merge_changed_under(
        warm, cmd, gate, gate.env(), lambda: replace_files(saves.b, ck, ("__0_0.distcp",))
    )
    _refused(done, "__0_0.distcp")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing published


@pytest.mark.slow
def test_an_object_replaced_while_the_merge_reads_it_is_refused(
    saves: Saves, s3_server: S3Server, tmp_path: Path, warm: Zygote
) -> None:
    bucket = s3_server.bucket("pins-replaced")
    fs = s3_server.fs()
    fs.put(str(saves.a), f"{bucket}/ck", recursive=True)
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(saves.config()))
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", str(out), "--checkpoint", f"s3://{bucket}/ck", "--max_shard_size", "1MB",
        "--quiet",
    ]  # fmt: skip
    other = (saves.b / "__0_0.distcp").read_bytes()  # the same size, other bytes

    def replace() -> None:
        fs.pipe(f"{bucket}/ck/__0_0.distcp", other)

    # paused at the first bytes written into the output (on whichever thread: the head start's
    # ranged GETs write as their bodies arrive), the object replaced, then the merge goes on
    gate = Gate(tmp_path / "gate", "os:pwrite", r"/model-00001-of-\d+\.safetensors$", thread=".")
    done = _merge_changed_under(warm, cmd, gate, gate.env(s3_server.env()), replace)
    line = _refused(done, f"s3://{bucket}/ck/__0_0.distcp")
    # the next ranged GET's If-Match: no byte of the new version
    assert "answers PreconditionFailed" in done.stderr, done.stderr
    assert "shardforge-staging" not in line
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing published


def test_a_file_rewritten_in_place_with_its_mtime_set_back_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(b"a" * 100)
    with pin_session():
        pinned = pin(data)
        rewrite_in_place(data, b"b" * 100, keep_mtime=True)
        assert data.stat().st_mtime_ns == pinned.local[3]  # the mtime says nothing changed
        with pytest.raises(CheckpointError, match=r"ctime \(ns\) \d+ -> \d+ \(changed in place"):
            open_regular(data)
        with pytest.raises(CheckpointError, match="changed while the merge read it"):
            check_all()
    assert set(pinned.describe()) == {"device", "inode", "size", "mtime_ns"}  # --resume's


def test_a_checkpoint_rewritten_in_place_with_its_mtime_set_back_mid_merge_is_refused(
    saves: Saves, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardforge.merge.api import merge_fsdp_weights

    ck = tmp_path / "ck"
    shutil.copytree(saves.a, ck)
    data, other = ck / "__0_0.distcp", (saves.b / "__0_0.distcp").read_bytes()
    done = change_after_plan(monkeypatch, data, lambda: rewrite_in_place(data, other, True))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: changed while the merge read it"):
        merge_fsdp_weights(saves.config(), out, checkpoint=ck, quiet=True)
    assert done and not out.exists() and not list(tmp_path.glob(".out*"))  # nothing published


def test_two_merges_on_two_threads_keep_their_own_pins(
    saves: Saves, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process, two merges on two threads, both pinned before either copies: the input of
    the second is replaced; only the second refuses (a process-wide session let the first
    check the second's pins, or one merge's publish forget the other's)."""
    import shardforge.merge.run as run_module
    from shardforge.merge.api import merge_fsdp_weights

    cks = [tmp_path / "ck1", tmp_path / "ck2"]
    for ck in cks:
        shutil.copytree(saves.a, ck)
    both = threading.Barrier(2, action=lambda: replace_files(saves.b, cks[1], ("__0_0.distcp",)))
    original = run_module.pinned_inputs

    def pinned_then_wait(sources: Any) -> Any:
        found = original(sources)
        both.wait(timeout=120)  # both merges have pinned; the barrier's action replaces ck2's
        return found

    monkeypatch.setattr(run_module, "pinned_inputs", pinned_then_wait)
    outcome: dict[int, BaseException | Path | str] = {}

    def merge(i: int) -> None:
        try:
            outcome[i] = merge_fsdp_weights(
                saves.config(), tmp_path / f"out{i}", checkpoint=cks[i], quiet=True
            )
        except BaseException as exc:
            outcome[i] = exc
            both.abort()

    threads = [threading.Thread(target=merge, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outcome[0] == tmp_path / "out0", outcome
    assert isinstance(outcome[1], CheckpointError), outcome
    assert "ck2/__0_0.distcp: changed while the merge read it" in str(outcome[1])
    assert (tmp_path / "out0" / "model.safetensors").is_file()
    assert not (tmp_path / "out1").exists() and not list(tmp_path.glob(".out*"))
