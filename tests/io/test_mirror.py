"""Checkpoints in object storage, read in place: a DCP and a rank-file checkpoint uploaded to the
loopback SeaweedFS and merged from s3:// give the bytes of a local merge, read by ranged
requests (the data files are stand-ins: nothing of them is downloaded whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.s3 import LAYOUTS, S3Server, layout_folder, tree_bytes
from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.io import mirror
from shardforge.merge.api import merge_fsdp_weights
from test_inspection import HF_STEP, Built, build_checkpoints

# the checkpoints are written by gloo ranks; the store is a child process
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every data file a stand-in, however small (the tiny model's shards are < 1 MiB)."""
    monkeypatch.setattr(mirror, "DOWNLOAD_LIMIT", 0)


def upload(server: S3Server, bucket: str, folder: Path, prefix: str) -> str:
    server.fs().put(str(folder), f"{bucket}/{prefix}", recursive=True)
    return f"s3://{bucket}/{prefix}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_s3_to_local_is_the_local_merge(
    layout: str, checkpoints: Built, s3_server: S3Server, stand_ins: None, tmp_path: Path
) -> None:
    folder = layout_folder(checkpoints.root, layout)
    bucket = s3_server.bucket(f"src-{layout}")
    uri = upload(s3_server, bucket, folder, "run/model")
    cfg = {"base_model": str(checkpoints.base), "storage_options": s3_server.storage_options}
    local = merge_fsdp_weights(
        {**cfg, "output_dir": "unused"}, tmp_path / "local", checkpoint=folder
    )
    gets = s3_server.ranged_gets(bucket)
    remote = merge_fsdp_weights(
        {**cfg, "output_dir": "unused"}, tmp_path / "remote", checkpoint=uri, verify=True
    )
    assert tree_bytes(remote) == tree_bytes(local)
    assert s3_server.ranged_gets(bucket) > gets  # the records were read by byte ranges


def test_output_dir_in_s3_and_messages_name_the_uri(
    checkpoints: Built,
    s3_server: S3Server,
    stand_ins: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket = s3_server.bucket("src-run")
    uri = upload(s3_server, bucket, checkpoints.root / "hf", "runs/hf")
    cfg = {
        "base_model": str(checkpoints.base),
        "output_dir": uri,
        "storage_options": s3_server.storage_options,
    }
    with caplog.at_level("INFO", logger="shardforge"):
        out = merge_fsdp_weights(cfg, tmp_path / "out")
    assert out == tmp_path / "out"
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"checkpoint: {uri}/checkpoint-") for line in lines), lines
    assert not [line for line in lines if "shardforge-staging" in line]
    capsys.readouterr()
    merge_fsdp_weights(cfg, tmp_path / "dry", dry_run=True)  # the plan, on stdout
    plan = capsys.readouterr().out
    assert f"\n  {uri}/checkpoint-7/" in plan, plan
    assert "shardforge-staging" not in plan
    local = merge_fsdp_weights(
        {**cfg, "output_dir": str(checkpoints.root / "hf")}, tmp_path / "local"
    )
    assert tree_bytes(out) == tree_bytes(local)
    with pytest.raises(CheckpointError) as err:
        merge_fsdp_weights(cfg, tmp_path / "none", step=12345)
    assert f"s3://{bucket}/runs/hf" in str(err.value)
    assert "shardforge-staging" not in str(err.value)


def test_a_missing_prefix_and_wrong_credentials_are_one_line(
    checkpoints: Built, s3_server: S3Server, tmp_path: Path
) -> None:
    bucket = s3_server.bucket("src-errors")
    cfg = {"base_model": str(checkpoints.base), "storage_options": s3_server.storage_options}
    with pytest.raises(CheckpointError, match=rf"s3://{bucket}/nothing: nothing is stored"):
        merge_fsdp_weights(cfg, tmp_path / "a", checkpoint=f"s3://{bucket}/nothing")
    wrong = {**s3_server.storage_options, "secret": "not-the-secret-key"}
    with pytest.raises(ShardforgeError) as err:
        merge_fsdp_weights(
            {**cfg, "storage_options": wrong}, tmp_path / "b", checkpoint=f"s3://{bucket}/x"
        )
    line = str(err.value)
    assert "access denied" in line and "credentials" in line and "\n" not in line
    assert "not-the-secret-key" not in line and s3_server.secret_key not in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_inspect_and_validate_know_s3(
    checkpoints: Built, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import yaml

    from shardforge.cli.inspect import do_inspect
    from shardforge.cli.validate import do_validate

    bucket = s3_server.bucket("inspect-run")
    uri = upload(s3_server, bucket, checkpoints.root / "hf", "runs/hf")
    for key, value in s3_server.env({}).items():
        monkeypatch.setenv(key, value)
    facts = json.loads(do_inspect(uri, as_json=True))
    local = json.loads(do_inspect(str(checkpoints.root / "hf"), as_json=True))
    assert facts["model_dir"] == f"{uri}/checkpoint-{HF_STEP}/pytorch_model_fsdp_0"
    assert facts["model"] == local["model"] and facts["world_size"] == local["world_size"]
    text = do_inspect(uri)
    assert uri in text and "shardforge-staging" not in text
    # the config names the store; validate shows the URI and hides the secret
    cfg = {"base_model": str(checkpoints.base), "output_dir": uri}
    cfg["storage_options"] = s3_server.storage_options
    (tmp_path / "cfg.yml").write_text(yaml.safe_dump(cfg))
    shown = do_validate(tmp_path / "cfg.yml", for_command="inspect")
    assert uri in shown and s3_server.secret_key not in shown and "'***'" in shown
    assert json.loads(do_inspect(tmp_path / "cfg.yml", as_json=True))["model_dir"].startswith(uri)


# every other format's checkpoint of one model, each saved by its trainer's own API
# (`helpers.shared.saved_formats`): folder under the shared root
SAVED_FORMATS = {
    "accelerate-bin": "accelerate/checkpoint_1",
    "dcp-ranks": "collective-free/checkpoint-2",
    "dcp-safetensors": "hf-sharded",
    "dcp-safetensors:consolidated": "titan/step-4",
}


@pytest.mark.parametrize("fmt", list(SAVED_FORMATS))
def test_every_format_merges_from_s3_as_from_disk(
    fmt: str,
    tmp_path_factory: pytest.TempPathFactory,
    s3_server: S3Server,
    stand_ins: None,
    tmp_path: Path,
) -> None:
    """Read through stand-ins (no data file downloaded whole), each format gives the bytes of
    its local merge: no reader of any format opens a stand-in's (empty) local file."""
    from helpers.shared import saved_formats

    saved = saved_formats(tmp_path_factory)
    folder = saved / SAVED_FORMATS[fmt]
    bucket = s3_server.bucket(f"fmt-{fmt.replace(':', '-')}")
    uri = upload(s3_server, bucket, folder, "ckpt")
    cfg = {"base_model": str(saved / "base"), "output_dir": "unused"}
    local = merge_fsdp_weights(cfg, tmp_path / "local", checkpoint=folder, quiet=True)
    gets = s3_server.ranged_gets(bucket)
    remote = merge_fsdp_weights(
        {**cfg, "storage_options": s3_server.storage_options},
        tmp_path / "remote",
        checkpoint=uri,
        verify=True,
        quiet=True,
    )
    assert tree_bytes(remote) == tree_bytes(local)
    assert s3_server.ranged_gets(bucket) > gets


def test_a_whole_copy_is_downloaded_once_per_staging_area(
    checkpoints: Built, s3_server: S3Server, stand_ins: None
) -> None:
    """`--verify` maps a rank file (`torch.load(mmap=True)` needs a real file): a stand-in's
    object is downloaded whole once per merge, not once per verification batch, and goes
    with the staging area."""
    folder = layout_folder(checkpoints.root, "rankfiles")
    bucket = s3_server.bucket("whole-copy")
    uri = upload(s3_server, bucket, folder, "actor")
    name = sorted(p.name for p in folder.iterdir() if p.suffix == ".pt")[0]
    with mirror.staging() as area:
        local = area.mirror(uri, s3_server.storage_options)
        copy = mirror.whole_copy(local / name)
        assert copy != local / name and copy.read_bytes() == (folder / name).read_bytes()
        first = copy.stat()
        assert mirror.whole_copy(local / name) == copy
        assert (copy.stat().st_ino, copy.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
        assert mirror.whole_copy(folder / name) == folder / name  # a local file: itself
    assert not copy.exists()


def test_staging_fetches_only_the_small_files_a_command_reads(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run prefix that also holds an archive and a log: only `.metadata`, JSON, tokenizer
    files and the like (each under the cap of its kind) are downloaded; the archive, the log,
    a JSON file over its cap and a large data file are sparse stand-ins of their size, and
    the archive's bytes are never fetched (the 400 MB training_data.tar, at test scale)."""
    monkeypatch.setattr(mirror, "FETCH_LIMITS", {**mirror.FETCH_LIMITS, "json": 4096})
    run = tmp_path / "run"
    (run / "checkpoint-2" / "model").mkdir(parents=True)
    (run / "additional_chat_templates").mkdir()
    read = {
        "checkpoint-2/model/.metadata": b"\x80\x04N.",
        "checkpoint-2/trainer_state.json": b'{"global_step": 2}',
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b"{}" + b" " * 6000,  # a tokenizer's cap, not a JSON file's
        "tokenizer.model": b"\x0a\x02ab",
        "additional_chat_templates/tool_use.jinja": b"{{ messages }}",
        "latest_checkpointed_iteration.txt": b"2",
    }
    unread = {
        "training_data.tar": (mirror.DOWNLOAD_LIMIT + (3 << 20), b"ustar"),
        "train.log": (200, b"step 1"),
        "results.json": (5000, b"{"),  # over the (patched) JSON cap
        "checkpoint-2/model/__0_0.distcp": (mirror.DOWNLOAD_LIMIT + 1, b"PK"),
    }
    for name, data in read.items():
        (run / name).write_bytes(data)
    for name, (size, head) in unread.items():
        (run / name).write_bytes(head + b"x" * (size - len(head)))
    bucket = s3_server.bucket("staging-fetch")
    uri = upload(s3_server, bucket, run, "run")
    with mirror.staging() as area:
        local = area.mirror(uri, s3_server.storage_options)
        for name, data in read.items():
            assert (local / name).read_bytes() == data, name
        for name, (size, _) in unread.items():
            st = (local / name).stat()
            assert (st.st_size, st.st_blocks) == (size, 0), name  # sparse: nothing fetched
    assert mirror.fetched("training_data.tar", 10) is False  # never, however small
    assert mirror.fetched(".metadata", 30 << 20) and not mirror.fetched(".metadata", (32 << 20) + 1)
