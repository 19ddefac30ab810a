"""The requests of an object-store output on a real S3 server (the loopback SeaweedFS): each
merge has its own journal key, and a cleanup (`Journal.abort_all`) goes on after a failed
request and tries each again, so an upload already gone or a store that restarts meanwhile
leaves neither open multipart uploads nor the journal."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from helpers.s3 import S3Server, start_server
from shardforge.errors import StorageError
from shardforge.io.mirror import RemoteTarget
from shardforge.io.remote import RemoteURI, filesystem
from shardforge.sinks import uploads
from shardforge.sinks.uploads import FileUpload, Journal, Store

# the store is a child process
pytestmark = pytest.mark.slow


def _open_uploads(store: Store) -> list[str]:
    page = store.call("list_multipart_uploads", Bucket=store.uri.bucket)
    return sorted(u["Key"] for u in page.get("Uploads", []))


def _journal(store: Store, names: list[str]) -> Journal:
    journal = Journal(store, "fp")
    for name in names:
        journal.files[name] = FileUpload(store.create(name), 5 << 20)
    journal.save()
    return journal


def test_abort_all_goes_on_after_a_failure_and_through_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(tmp_path / "store")
    try:
        bucket = server.bucket("uploads")
        options = server.storage_options
        target = RemoteTarget(RemoteURI(bucket, "out/m"), filesystem(options), options, tmp_path)
        store = Store(target)
        # two merges to one prefix: each its own journal; one's cleanup leaves the other's
        winner, refused = _journal(store, ["w.safetensors"]), _journal(store, ["a", "b", "c"])
        assert winner.key != refused.key
        assert [k for k, _ in Journal.found(store)] == sorted([winner.key, refused.key])
        # the first upload is gone already (aborted by another cleanup): the rest still goes
        store.abort("a", refused.files["a"].upload_id)
        assert not refused.abort_all().failed
        assert [k for k, _ in Journal.found(store)] == [winner.key]
        assert _open_uploads(store) == ["out/m/w.safetensors"]
        # the store goes down during the cleanup and comes back: each request is tried again
        monkeypatch.setattr(uploads, "CLEANUP_TRIES", 1000)
        monkeypatch.setattr(uploads, "CLEANUP_S", 600.0)
        server.kill()
        with caplog.at_level("INFO", logger="shardforge"):
            cleanup = threading.Thread(target=winner.abort_all)
            cleanup.start()
            while "trying again" not in caplog.text:  # a request failed
                assert cleanup.is_alive()
                time.sleep(0.1)
            server.restart()
            cleanup.join(timeout=300)
        assert not cleanup.is_alive()
        assert Journal.found(store) == [] and _open_uploads(store) == []
    finally:
        server.stop()


def test_a_failure_is_told_apart_by_its_type_and_code_not_its_words(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload that is gone (NoSuchUpload) is done for a cleanup, and a store that cannot be
    reached is not asked again, whatever the messages say (here: words that say nothing)."""
    from helpers.s3 import free_ports
    from shardforge.io import remote

    bucket = s3_server.bucket("uploads-kinds")
    options = s3_server.storage_options
    store = Store(RemoteTarget(RemoteURI(bucket, "m"), filesystem(options), options, tmp_path))
    upload = store.create("w")
    store.abort("w", upload)
    monkeypatch.setattr(remote, "_reason", lambda exc: "words that say nothing")
    monkeypatch.setattr(uploads, "CLEANUP_TRIES", 2)
    with pytest.raises(StorageError) as err:
        store.on_object("list_parts", "w", UploadId=upload)
    assert err.value.kind == "missing", err.value.message
    cleanup = uploads.Cleanup()
    cleanup("list w", lambda: store.on_object("list_parts", "w", UploadId=upload))
    assert cleanup.failed == []
    (port,) = free_ports(1)
    dead = {
        **options,
        "endpoint_url": f"http://127.0.0.1:{port}",  # nothing listens there
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    monkeypatch.setattr(uploads, "CLEANUP_TRIES", 1)
    down = Store(RemoteTarget(RemoteURI(bucket, "m"), filesystem(dead), dead, tmp_path))
    cleanup("delete a", lambda: down.delete(down.key("a")))
    cleanup("delete b", lambda: down.delete(down.key("b")))
    assert cleanup.unreachable and cleanup.failed[1].endswith(
        "not tried (the object store cannot be reached)"
    ), cleanup.failed


def test_only_the_adapter_uses_s3fs_internals() -> None:
    """s3fs's private request coroutine, its event loop and fsspec's `sync` appear in one module
    (`io/s3_adapter.py`)."""
    import re

    import shardforge

    src = Path(shardforge.__file__).parent
    uses = re.compile(r"_call_s3|\bcall_s3\b|fs\.loop\b|fsspec\.asyn")
    found = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if uses.search(p.read_text()))
    assert found == ["io/s3_adapter.py"], found
