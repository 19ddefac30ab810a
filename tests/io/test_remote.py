"""Remote objects as bytes: URIs, ranged reads (small ones cached, large ones in parallel
parts) checked against the stored bytes on the loopback SeaweedFS, stand-ins served through
the byte path's own functions, a large copy streamed without holding its parts, failed
requests as one line without a secret, and an object replaced while it is read (another
version, a shorter one) named as changed, never read from its new version."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import blake3
import pytest

from helpers.s3 import S3Server
from shardforge.errors import CheckpointError, StorageError
from shardforge.io import remote
from shardforge.io.copy import copy_range
from shardforge.io.digest import FileHash, hashing
from shardforge.io.files import read_exact_into
from shardforge.io.remote import (
    RemoteObject,
    RemoteURI,
    changed_objects,
    filesystem,
    redact,
    storage_error,
)


def test_uris() -> None:
    uri = RemoteURI.parse("s3://bucket/run/step-1/")
    assert (uri.bucket, uri.key, uri.path, uri.name) == (
        "bucket",
        "run/step-1",
        "bucket/run/step-1",
        "step-1",
    )
    assert str(uri.child("__0_0.distcp")) == "s3://bucket/run/step-1/__0_0.distcp"
    assert uri.relative("bucket/run/step-1/a/b") == "a/b"
    assert RemoteURI.parse("s3://bucket").key == ""
    with pytest.raises(StorageError, match="not an object-storage URI"):
        RemoteURI.parse("gs://bucket/x")
    assert (
        remote.is_remote("s3://b/k")
        and not remote.is_remote("/s3/b")
        and not remote.is_remote(None)
    )


def test_errors_are_one_line_without_secrets() -> None:
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    exc = PermissionError(f"denied for {secret}: Signature=abcdef&X-Amz-Credential=AKIA")
    err = storage_error(exc, "s3://b/k", [secret])
    assert err.message.startswith("s3://b/k: access denied")
    assert secret not in err.message and "abcdef" not in err.message
    assert "\n" not in err.message and len(err.message) < 300
    assert (
        "no such bucket"
        in storage_error(
            FileNotFoundError("The specified bucket does not exist"), "s3://b", []
        ).message
    )
    assert redact("key=AKIA secret=xyz1234", ["xyz1234"]) == "key=AKIA secret=***"


@pytest.mark.slow
def test_ranged_reads_are_the_stored_bytes(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket = s3_server.bucket("remote-reads")
    data = os.urandom(3 * (1 << 20) + 12345)
    s3_server.fs().pipe(f"{bucket}/obj.bin", data)
    monkeypatch.setattr(remote, "PART_BYTES", 256 << 10)  # several parallel parts
    obj = RemoteObject(
        filesystem(s3_server.storage_options), RemoteURI(bucket, "obj.bin"), len(data)
    )
    for offset, n in [(0, 10), (300_000, 70_000), (1, len(data) - 1), (len(data) - 5, 5)]:
        assert obj.read(n, offset) == data[offset : offset + n], (offset, n)
        buf = bytearray(n)
        obj.read_into(memoryview(buf), offset, "obj")
        assert bytes(buf) == data[offset : offset + n]
    assert obj.read(10, len(data)) == b""
    with pytest.raises(CheckpointError, match="short read"):
        obj.read_into(memoryview(bytearray(100)), len(data) - 50, "obj")
    # a stand-in: a sparse local file whose reads the byte path sends to the store
    stand_in = tmp_path / "stand-in"
    stand_in.touch()
    os.truncate(stand_in, len(data))
    remote.register_stand_in(stand_in.stat(), obj)
    try:
        fd = os.open(stand_in, os.O_RDONLY)
        out = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT)
        try:
            buf = bytearray(1000)
            read_exact_into(fd, buf, 2_000_000, "stand-in")
            assert bytes(buf) == data[2_000_000:2_001_000]
            assert remote.pread(fd, 4, 0) == data[:4]
            copy_range(fd, out, 100, 0, len(data) - 100)
            assert (tmp_path / "copy").read_bytes() == data[100:]
        finally:
            os.close(fd)
            os.close(out)
    finally:
        st = stand_in.stat()
        remote.forget_stand_ins([(st.st_dev, st.st_ino)])
    assert stand_in.stat().st_blocks == 0  # nothing of it was stored locally


@pytest.mark.slow
def test_a_large_copy_is_streamed_not_held(s3_server: S3Server, tmp_path: Path) -> None:
    """48 MiB copied into a local file in parts of 16 MiB, 8 GETs at once: the bytes Python
    holds at any time stay at a few pieces of `STREAM_CHUNK`, far below one part. Into a hashed
    output (the merge's path: `copy_range` from a stand-in, the manifest's hash), each part
    tells the hash where it landed and the hash reads it back from the output: nothing kept,
    and the digest is blake3's of the data."""
    bucket = s3_server.bucket("remote-stream")
    data = os.urandom(48 << 20)
    s3_server.fs().pipe(f"{bucket}/big.bin", data)
    obj = RemoteObject(
        filesystem(s3_server.storage_options), RemoteURI(bucket, "big.bin"), len(data)
    )
    obj.read(10, 0)  # the client made (its S3 model loaded) before measuring
    stand_in = tmp_path / "stand-in"
    stand_in.touch()
    os.truncate(stand_in, len(data))
    remote.register_stand_in(stand_in.stat(), obj)
    fd = os.open(stand_in, os.O_RDONLY)
    peaks = []
    try:
        for name in ("copy", "hashed"):
            out = os.open(tmp_path / name, os.O_RDWR | os.O_CREAT)
            h = FileHash(tmp_path / name) if name == "hashed" else None
            try:
                tracemalloc.start()
                with hashing(out, h):
                    copy_range(fd, out, 0, 0, len(data))
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
                os.close(out)
            assert (tmp_path / name).read_bytes() == data
            if h is not None:
                assert h.hexdigest(len(data)) == blake3.blake3(data).hexdigest()
    finally:
        os.close(fd)
        st = stand_in.stat()
        remote.forget_stand_ins([(st.st_dev, st.st_ino)])
    # the old paths held 8 whole parts (128 MiB); a hashed copy keeps no part
    assert max(peaks) < remote.PART_BYTES, peaks


@pytest.mark.slow
def test_wrong_credentials_and_a_missing_bucket(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bucket = s3_server.bucket("remote-errors")
    s3_server.fs().pipe(f"{bucket}/x", b"abc")
    wrong = {**s3_server.storage_options, "secret": "the-wrong-secret-key"}
    obj = RemoteObject(filesystem(wrong), RemoteURI(bucket, "x"), 3, wrong)
    with pytest.raises(StorageError) as err:
        obj.read(3, 0)
    assert err.value.message.startswith(f"s3://{bucket}/x: access denied")
    assert "the-wrong-secret-key" not in str(err.value)
    # a streamed copy in parts (one at a time): the first failed part is the one error
    monkeypatch.setattr(remote, "PART_BYTES", 1)
    monkeypatch.setattr(remote, "PARALLEL", 1)
    out = os.open(tmp_path / "copy", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(StorageError, match="access denied"):
            obj.copy_to(out, 0, 0, 3)
    finally:
        os.close(out)
    gone = RemoteObject(filesystem(s3_server.storage_options), RemoteURI("no-such-bucket", "x"), 3)
    with pytest.raises(StorageError, match="no such bucket"):
        gone.read(3, 0)


@pytest.mark.slow
def test_the_same_options_give_one_client_after_requests(s3_server: S3Server) -> None:
    """botocore rewrites the `retries` it is given (`max_attempts` -> `total_max_attempts`): the
    options of the next `filesystem` call must not change with it, or fsspec's instance cache
    misses and every call makes another S3 client (each with its own ~16 MB S3 model)."""
    bucket = s3_server.bucket("remote-one-client")
    defaults = repr(remote.DEFAULT_CONFIG)
    options = {**s3_server.storage_options, "config_kwargs": {"retries": {"max_attempts": 2}}}
    given = repr(options)
    fs = filesystem(options)
    fs.ls(bucket, refresh=True)  # a request: botocore has read (and rewritten) its config
    assert filesystem(options) is fs
    assert filesystem(dict(options)) is fs
    assert repr(remote.DEFAULT_CONFIG) == defaults and repr(options) == given


def test_the_docs_local_s3_recipe_starts_the_tests_server() -> None:
    """docs/storage.md's `weed server` line gives every flag the tests' server has (ports, data
    folder and identities aside) and sets the AWS variables the tests set."""
    import re
    import shlex

    from helpers.s3 import FLAGS

    text = (Path(__file__).resolve().parents[2] / "docs" / "storage.md").read_text()
    recipe = text[text.index("## Try it locally") :].replace("\\\n", " ")
    line = next(x for x in recipe.splitlines() if x.startswith("weed server "))
    words = shlex.split(line.split(">")[0])
    assert set(FLAGS) <= set(words), set(FLAGS) - set(words)
    assert {w.split("=")[0] for w in words if w.startswith("-")} >= {"-dir", "-s3.config"}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert re.search(rf"\b{name}=\S+", recipe), name
    for command in ("shardforge merge-sharded-fsdp-weights", "shardforge verify s3://"):
        assert command in recipe
    assert "output_dir: s3://" in recipe


@pytest.mark.slow
def test_an_object_replaced_while_it_is_read_is_named_as_changed(s3_server: S3Server) -> None:
    bucket = s3_server.bucket("remote-changed")
    fs = s3_server.fs()
    data = os.urandom(300_000)
    fs.pipe(f"{bucket}/o", data)
    etag = fs.info(f"{bucket}/o")["ETag"]
    client = filesystem(s3_server.storage_options)
    pinned = RemoteObject(client, RemoteURI(bucket, "o"), len(data), etag=etag)
    listed = RemoteObject(client, RemoteURI(bucket, "o"), len(data))  # no ETag known
    assert pinned.read(200_000, 0) == data[:200_000] and changed_objects([pinned, listed]) == []
    fs.pipe(f"{bucket}/o", data[:1000])  # replaced by a shorter one
    for obj in (pinned, listed):
        for offset in (150_000, 500):  # past its new end; across it
            with pytest.raises(CheckpointError, match="changed while the merge read it") as err:
                obj.read_into(memoryview(bytearray(100_000)), offset, "s3://remote-changed/o")
            assert "throttling" not in str(err.value)
    assert [how for _, how in changed_objects([pinned, listed])] == [
        f"ETag {etag} -> {fs.info(f'{bucket}/o')['ETag']}",
        "size 300000 -> 1000",
    ]
    fs.pipe(f"{bucket}/o", os.urandom(len(data)))  # the same size, other bytes
    with pytest.raises(CheckpointError, match="answers PreconditionFailed"):
        pinned.read(100_000, 100_000)  # If-Match: never a byte of another version
