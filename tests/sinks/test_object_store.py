"""Merged models published to object storage (the loopback SeaweedFS): local -> S3 and S3 -> S3
give the bytes of a local merge for a DCP and a rank-file checkpoint, verified there; a merge
killed mid-upload leaves nothing under the prefix and `--resume` uploads only what is left;
wrong credentials, a missing bucket, an existing prefix and an outage are one-line errors with
nothing published; --overwrite replaces a model only; a signal in the publish window leaves no
object; a refused merge's cleanup leaves another merge's journal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.gate import Gate
from helpers.s3 import LAYOUTS, S3Server, layout_folder, start_server, tree_bytes
from helpers.zygote import Zygote, killed_at, zygote_fixture
from shardforge.errors import MergeError, StorageError
from shardforge.io import mirror
from shardforge.io.remote import RemoteURI, filesystem, storage_errors
from shardforge.merge.api import merge_fsdp_weights
from shardforge.sinks.object_store import ObjectStoreSink
from shardforge.sinks.uploads import FileRange, Store
from test_inspection import Built, build_checkpoints

# gloo ranks write the checkpoints; the store is a child process
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def warm(request: pytest.FixtureRequest) -> Iterator[Zygote]:
    """The merges a test stops, signals or kills: forked from a process that has imported
    the merge once (`helpers.zygote`), not a new interpreter each."""
    yield from zygote_fixture(request)


LocalMerge = Callable[..., dict[str, bytes]]


@pytest.fixture(scope="module")
def local_merge(checkpoints: Built, tmp_path_factory: pytest.TempPathFactory) -> LocalMerge:
    """`local_merge(layout, max_shard_size=None)`: the bytes of a local merge of that layout's
    checkpoint (what each published model is compared with), merged once per module."""
    root = tmp_path_factory.mktemp("local-merges")
    made: dict[tuple[str, str | None], dict[str, bytes]] = {}

    def local(layout: str, max_shard_size: str | None = None) -> dict[str, bytes]:
        if (layout, max_shard_size) not in made:
            config = {"base_model": str(checkpoints.base), "output_dir": "unused"}
            more = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            folder = layout_folder(checkpoints.root, layout)
            out = root / f"{layout}-{max_shard_size}"
            made[layout, max_shard_size] = tree_bytes(
                merge_fsdp_weights(config, out, checkpoint=folder, **more)
            )
        return made[layout, max_shard_size]

    return local


def stored(server: S3Server, prefix: str, into: Path) -> dict[str, bytes]:
    """Every object under `prefix` (bucket/key), downloaded."""
    fs = server.fs()
    fs.get(prefix + "/", str(into) + "/", recursive=True)
    return tree_bytes(into)


def keys(server: S3Server, prefix: str) -> list[str]:
    """The objects under `prefix` (not the empty folder SeaweedFS keeps once they are gone)."""
    fs = server.fs()
    fs.invalidate_cache()
    return sorted(k for k, info in fs.find(prefix, detail=True).items() if info["type"] == "file")


def journals(server: S3Server, bucket: str, name: str) -> list[str]:
    """The journals of the merges to `s3://bucket/name` (beside the prefix, one per merge)."""
    fs = server.fs()
    fs.invalidate_cache()
    return sorted(fs.glob(f"{bucket}/.{name}.shardforge-merge*.json"))


def cfg(checkpoints: Built, server: S3Server, **more: Any) -> dict[str, Any]:
    return {
        "base_model": str(checkpoints.base),
        "output_dir": "unused",
        "storage_options": server.storage_options,
        **more,
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_to_s3_and_s3_to_s3_are_the_local_merge(
    layout: str,
    checkpoints: Built,
    local_merge: LocalMerge,
    s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(mirror, "DOWNLOAD_LIMIT", 0)  # every data file read by ranges
    folder = layout_folder(checkpoints.root, layout)
    bucket = s3_server.bucket(f"out-{layout}")
    config = cfg(checkpoints, s3_server)
    want = local_merge(layout, "150KB")
    assert len([n for n in want if n.endswith(".safetensors")]) > 1  # sharded: index published
    merge_fsdp_weights(
        config, f"s3://{bucket}/up", checkpoint=folder, max_shard_size="150KB", verify=True
    )
    assert stored(s3_server, f"{bucket}/up", tmp_path / "up") == want
    s3_server.fs().put(str(folder), f"{bucket}/ckpt", recursive=True)
    with caplog.at_level("INFO", logger="shardforge"):
        both = merge_fsdp_weights(
            config, f"s3://{bucket}/both", checkpoint=f"s3://{bucket}/ckpt", max_shard_size="150KB"
        )
    assert both == f"s3://{bucket}/both"  # the URI, not the staging folder
    lines = [r.getMessage() for r in caplog.records]
    assert f"wrote s3://{bucket}/both" in "\n".join(lines), lines
    assert not [line for line in lines if "shardforge-staging" in line]
    assert stored(s3_server, f"{bucket}/both", tmp_path / "both") == want
    # the prefix is taken: refused without --overwrite, replaced with it (unsharded now)
    with pytest.raises(MergeError, match="pass --overwrite"):
        merge_fsdp_weights(config, f"s3://{bucket}/up", checkpoint=folder)
    merge_fsdp_weights(config, f"s3://{bucket}/up", checkpoint=folder, overwrite=True, verify=True)
    assert stored(s3_server, f"{bucket}/up", tmp_path / "up2") == local_merge(layout)


def test_killed_mid_upload_leaves_no_model_and_resume_uploads_the_rest(
    checkpoints: Built, local_merge: LocalMerge, s3_server: S3Server, tmp_path: Path, warm: Zygote
) -> None:
    folder = layout_folder(checkpoints.root, "dcp")
    bucket = s3_server.bucket("out-resume")
    config = cfg(checkpoints, s3_server)
    want = local_merge("dcp", "150KB")
    shards = sorted(n for n in want if n.endswith(".safetensors"))
    assert len(shards) >= 3
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump({**config, "storage_options": None}))
    # paused once the first shard is uploaded (at the first write of the second one: its header)
    gate = Gate(tmp_path / "gate", "os:pwrite", r"/output-[^/]+/model-00002-of-\d+\.safetensors$")
    cmd = [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", f"s3://{bucket}/model", "--checkpoint", str(folder),
        "--max_shard_size", "150KB", "--quiet",
    ]  # fmt: skip
    killed_at(warm, gate, cmd, gate.env(s3_server.env()))
    assert keys(s3_server, f"{bucket}/model") == []  # no index, no shard, nothing
    assert len(journals(s3_server, bucket, "model")) == 1  # the journal beside it
    before = s3_server.received_bytes(bucket)
    merge_fsdp_weights(
        config, f"s3://{bucket}/model", checkpoint=folder, max_shard_size="150KB", resume=True
    )
    sent = s3_server.received_bytes(bucket) - before
    assert stored(s3_server, f"{bucket}/model", tmp_path / "resumed") == want
    rest = sum(len(want[n]) for n in shards[1:])
    small = sum(len(b) for n, b in want.items() if not n.endswith(".safetensors"))
    assert rest <= sent < rest + small + 64 * 1024  # the first shard was not uploaded again
    assert journals(s3_server, bucket, "model") == []


def test_credentials_bucket_and_an_outage_are_one_line_with_nothing_published(
    checkpoints: Built, s3_server: S3Server, tmp_path: Path, warm: Zygote
) -> None:
    folder = layout_folder(checkpoints.root, "rankfiles")
    config = cfg(checkpoints, s3_server)
    wrong = cfg(
        checkpoints, s3_server, storage_options={**s3_server.storage_options, "secret": "x" * 20}
    )
    bucket = s3_server.bucket("out-errors")
    with pytest.raises(StorageError) as err:
        merge_fsdp_weights(wrong, f"s3://{bucket}/m", checkpoint=folder)
    assert "access denied" in err.value.message and "x" * 20 not in str(err.value)
    with pytest.raises(StorageError, match="no such bucket"):
        merge_fsdp_weights(config, "s3://no-such-bucket/m", checkpoint=folder)
    assert keys(s3_server, f"{bucket}/m") == []
    # an outage: the server dies while the merge uploads
    server = start_server(tmp_path / "outage")
    try:
        out_bucket = server.bucket("outage")
        (tmp_path / "cfg.yml").write_text(yaml.safe_dump({**config, "storage_options": None}))
        gate = Gate(
            tmp_path / "gate", "os:pwrite", r"/output-[^/]+/model-00002-of-\d+\.safetensors$"
        )
        cmd = [
            sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights",
            str(tmp_path / "cfg.yml"), "--output_path", f"s3://{out_bucket}/m",
            "--checkpoint", str(folder), "--max_shard_size", "150KB", "--quiet",
        ]  # fmt: skip
        proc = warm.popen(cmd, env=gate.env(server.env()), stderr=subprocess.PIPE)
        try:
            gate.wait(proc)
            server.kill()
        finally:
            gate.open()
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=240)
        assert time.monotonic() - start < 120
        assert proc.returncode != 0
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in stderr, stderr
        assert f"s3://{out_bucket}/m" in errors[0] and "cannot be reached" in errors[0], errors
        server.restart()
        assert keys(server, f"{out_bucket}/m") == []
    finally:
        server.stop()


def test_a_part_is_sent_from_the_staging_file_not_held(s3_server: S3Server, tmp_path: Path) -> None:
    """A 32 MiB part read from its file as it is sent (checksum, signature, request): the
    bytes Python holds meanwhile stay far below the part."""
    bucket = s3_server.bucket("out-stream")
    data = os.urandom(32 << 20)
    (tmp_path / "staged").write_bytes(data)
    options = s3_server.storage_options
    target = mirror.RemoteTarget(RemoteURI(bucket, "m"), filesystem(options), options, tmp_path)
    store = Store(target)
    upload_id = store.create("w.bin")
    fd = os.open(tmp_path / "staged", os.O_RDONLY)
    try:
        tracemalloc.start()
        etag = store.upload("w.bin", upload_id, 1, FileRange(fd, 1 << 20, len(data)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(fd)
    store.complete("w.bin", upload_id, {1: etag})
    assert s3_server.fs().cat_file(f"{bucket}/m/w.bin") == data[1 << 20 :]
    assert peak < 8 << 20, peak


def _merge_cmd(tmp_path: Path, folder: Path, uri: str, *more: str) -> list[str]:
    return [
        sys.executable, "-m", "shardforge", "merge-sharded-fsdp-weights", str(tmp_path / "cfg.yml"),
        "--output_path", uri, "--checkpoint", str(folder), "--max_shard_size", "150KB", "--quiet",
        *more,
    ]  # fmt: skip


def test_overwrite_replaces_a_model_prefix_only(
    checkpoints: Built, local_merge: LocalMerge, s3_server: S3Server, tmp_path: Path
) -> None:
    """A prefix holding a training run (two checkpoints with optimizer state, metrics, notes)
    is refused by --overwrite, naming what it holds, and left as it was; one holding a
    previous model is replaced; --overwrite_non_model replaces anything."""
    folder = layout_folder(checkpoints.root, "rankfiles")
    bucket = s3_server.bucket("out-overwrite-run")
    config = cfg(checkpoints, s3_server)
    want = local_merge("rankfiles")
    fs = s3_server.fs()
    for step in (10, 20):
        fs.pipe(f"{bucket}/run/checkpoint-{step}/optimizer_0/__0_0.distcp", os.urandom(512))
        fs.pipe(f"{bucket}/run/checkpoint-{step}/trainer_state.json", b'{"global_step": 1}')
    fs.pipe(f"{bucket}/run/metrics.jsonl", b'{"loss": 1.5}\n')
    fs.pipe(f"{bucket}/run/notes.md", b"mine")
    fs.pipe(f"{bucket}/run/config.json", b"{}")
    before = stored(s3_server, f"{bucket}/run", tmp_path / "before")
    uri = f"s3://{bucket}/run"
    with pytest.raises(MergeError, match="pass --overwrite"):
        merge_fsdp_weights(config, uri, checkpoint=folder)
    with pytest.raises(MergeError) as err:
        merge_fsdp_weights(config, uri, checkpoint=folder, overwrite=True)
    assert err.value.message.startswith(
        f"{uri}: holds more than a model (checkpoint-10/, checkpoint-20/, metrics.jsonl, ... "
        "(4 entries)); "
    ), err.value.message
    assert "--overwrite_non_model" in err.value.message
    assert stored(s3_server, f"{bucket}/run", tmp_path / "after") == before
    assert journals(s3_server, bucket, "run") == []
    merge_fsdp_weights(config, uri, checkpoint=folder, overwrite=True, overwrite_non_model=True)
    assert stored(s3_server, f"{bucket}/run", tmp_path / "replaced") == want
    # a previous model (and a stale shard of another one) is what --overwrite replaces
    fs.pipe(f"{bucket}/run/model-00001-of-00003.safetensors", b"a previous merge's shard")
    merge_fsdp_weights(config, uri, checkpoint=folder, overwrite=True)
    assert stored(s3_server, f"{bucket}/run", tmp_path / "again") == want


@pytest.mark.parametrize(
    ("signum", "frozen_at"),
    [(signal.SIGTERM, "Store.complete"), (signal.SIGINT, "Store.put")],
    ids=["sigterm-at-complete", "sigint-at-put"],
)
def test_a_signal_in_the_publish_window_leaves_no_object(
    signum: int,
    frozen_at: str,
    checkpoints: Built,
    local_merge: LocalMerge,
    s3_server: S3Server,
    tmp_path: Path,
    warm: Zygote,
) -> None:
    """The merge frozen the moment its first shard (or config) object exists under the prefix,
    before it has taken note of it, then signalled: the cleanup removes that object too, the
    prefix and its journal are left empty, and a rerun publishes."""
    folder = layout_folder(checkpoints.root, "dcp")
    bucket = s3_server.bucket(f"out-window-{signum}")
    config = cfg(checkpoints, s3_server)
    want = local_merge("dcp", "150KB")
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump({**config, "storage_options": None}))
    # paused right after the request returned: the object exists, the merge has not recorded it
    gate = Gate(tmp_path / "gate", f"shardforge.sinks.uploads:{frozen_at}", r"model")
    cmd = _merge_cmd(tmp_path, folder, f"s3://{bucket}/model")
    proc = warm.popen(cmd, env=gate.env(s3_server.env()), stderr=subprocess.PIPE)
    try:
        gate.wait(proc)
        assert keys(s3_server, f"{bucket}/model")  # the first object is there
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=240)
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "error: interrupted" in stderr, stderr
    assert keys(s3_server, f"{bucket}/model") == []
    assert journals(s3_server, bucket, "model") == []
    merge_fsdp_weights(config, f"s3://{bucket}/model", checkpoint=folder, max_shard_size="150KB")
    assert stored(s3_server, f"{bucket}/model", tmp_path / "rerun") == want


def test_a_refused_merge_leaves_the_other_merges_journal(
    checkpoints: Built,
    local_merge: LocalMerge,
    s3_server: S3Server,
    tmp_path: Path,
    warm: Zygote,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two merges to one prefix: B passes its checks, then A starts and completes its first
    shard; B is refused at publishing. B's cleanup removes B's journal only: A, killed then,
    is resumed from its own and publishes the model."""
    folder = layout_folder(checkpoints.root, "dcp")
    bucket = s3_server.bucket("out-two-merges")
    uri = f"s3://{bucket}/model"
    config = cfg(checkpoints, s3_server)
    want = local_merge("dcp", "150KB")
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump({**config, "storage_options": None}))
    gate = Gate(tmp_path / "gate", "shardforge.sinks.uploads:Store.complete", r"model")
    cmd = _merge_cmd(tmp_path, folder, uri)
    started: list[Any] = []
    real_journal = ObjectStoreSink._journal

    def a_starts_now(sink: ObjectStoreSink, *args: Any) -> Any:  # B has passed its checks
        a = warm.popen(cmd, env=gate.env(s3_server.env()), stderr=subprocess.PIPE)
        started.append(a)
        gate.wait(a)  # A completed its first shard and waits
        return real_journal(sink, *args)

    monkeypatch.setattr(ObjectStoreSink, "_journal", a_starts_now)
    try:
        with pytest.raises(MergeError, match="objects appeared under the prefix"):
            merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB")
        monkeypatch.undo()
        (a,) = started
        left = journals(s3_server, bucket, "model")
        assert len(left) == 1, left
        assert json.loads(s3_server.fs().cat_file(left[0]))["owner"]["pid"] == a.pid  # A's
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        gate.open()
        for p in started:
            if p.poll() is None:
                p.kill()
    merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB", resume=True)
    assert stored(s3_server, f"{bucket}/model", tmp_path / "resumed") == want
    assert journals(s3_server, bucket, "model") == []


@pytest.mark.parametrize("fails_from", ["manifest", "journal"])
def test_an_outage_right_after_the_index_is_published_keeps_the_model(
    fails_from: str,
    checkpoints: Built,
    local_merge: LocalMerge,
    s3_server: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store stops answering the moment the index is published (a fault hook on the
    store's requests): from the manifest's PUT on, or at the journal's removal only. The
    published model stays; a manifest not put is an error that says so, its journal kept, and
    `--resume` puts it and removes the journal; a journal not removed is a warning, and the
    next plain merge to the prefix removes it (and refuses to replace the model)."""
    from shardforge.sinks import uploads

    folder = layout_folder(checkpoints.root, "dcp")
    bucket = s3_server.bucket(f"out-after-index-{fails_from}")
    uri = f"s3://{bucket}/model"
    config = cfg(checkpoints, s3_server)
    want = local_merge("dcp", "150KB")
    down = [False]
    real_put, real_call = uploads.Store.put, uploads.Store.call

    def put(store: Store, name: str, body: bytes) -> None:
        real_put(store, name, body)
        down[0] = down[0] or name == "model.safetensors.index.json"

    def call(store: Store, method: str, where: object = None, **kwargs: Any) -> Any:
        manifest = kwargs.get("Key", "").endswith("/shardforge-manifest.json")
        if down[0] and (fails_from == "manifest" or not manifest):
            with storage_errors(where or store.uri):
                raise ConnectionRefusedError("Cannot connect to host (the test's outage)")
        return real_call(store, method, where, **kwargs)

    monkeypatch.setattr(uploads, "CLEANUP_TRIES", 1)
    monkeypatch.setattr(uploads.Store, "put", put)
    monkeypatch.setattr(uploads.Store, "call", call)
    published = sorted(n for n in want if n != "shardforge-manifest.json")
    assert len(published) < len(want)
    if fails_from == "manifest":
        with pytest.raises(StorageError) as err:
            merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB")
        assert "the model is published" in err.value.message and "--resume" in err.value.message
    else:
        with caplog.at_level("WARNING", logger="shardforge"):
            merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB")
        assert "--resume or a later merge to it removes what is left" in caplog.text
        published = sorted(want)
    monkeypatch.undo()
    assert sorted(stored(s3_server, f"{bucket}/model", tmp_path / "left")) == published
    assert len(journals(s3_server, bucket, "model")) == 1
    if fails_from == "manifest":
        merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB", resume=True)
    else:
        with pytest.raises(MergeError, match="pass --overwrite"):
            merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB")
    assert stored(s3_server, f"{bucket}/model", tmp_path / "finished") == want
    assert journals(s3_server, bucket, "model") == []


def test_resume_after_a_kill_9_in_the_publish_finishes_it(
    checkpoints: Built, local_merge: LocalMerge, s3_server: S3Server, tmp_path: Path, warm: Zygote
) -> None:
    """`kill -9` of a merge right after its first small object (the chat template) is put, before
    the index and the manifest: `--resume` counts what the interrupted merge put as its own (its
    journal lists them). An object that did appear meanwhile refuses it, naming that object
    and keeping the journal; once it is gone, `--resume` publishes the model and removes the
    journal."""
    folder = layout_folder(checkpoints.root, "dcp")
    bucket = s3_server.bucket("out-kill-in-publish")
    uri = f"s3://{bucket}/model"
    config = cfg(checkpoints, s3_server)
    want = local_merge("dcp", "150KB")
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump({**config, "storage_options": None}))
    gate = Gate(tmp_path / "gate", "shardforge.sinks.uploads:Store.put", r"model")
    killed_at(warm, gate, _merge_cmd(tmp_path, folder, uri), gate.env(s3_server.env()))
    assert [k for k in keys(s3_server, f"{bucket}/model") if not k.endswith(".safetensors")]
    assert len(journals(s3_server, bucket, "model")) == 1
    fs = s3_server.fs()
    fs.pipe(f"{bucket}/model/notes.md", b"mine")
    with pytest.raises(MergeError, match="objects appeared under the prefix") as err:
        merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB", resume=True)
    assert err.value.details == ["notes.md"], err.value.details
    assert len(journals(s3_server, bucket, "model")) == 1
    fs.rm(f"{bucket}/model/notes.md")
    merge_fsdp_weights(config, uri, checkpoint=folder, max_shard_size="150KB", resume=True)
    assert stored(s3_server, f"{bucket}/model", tmp_path / "resumed") == want
    assert journals(s3_server, bucket, "model") == []
