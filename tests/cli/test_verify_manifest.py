"""`shardforge verify` reads the manifest as untrusted input (`cli.verify_manifest`): a path
that leaves the directory, a field of the wrong kind, deep nesting and a huge manifest are each
one `error:` line, before anything the manifest names is read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import blake3
import pytest
from click.testing import CliRunner, Result

from helpers.s3 import S3Server
from shardforge.cli import verify_manifest
from shardforge.cli.main import cli
from shardforge.io.digest import Digests
from shardforge.sinks.manifest import MANIFEST, canonical, write_manifest


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["verify", *(str(a) for a in args)])


def one_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    (line, *_) = result.stderr.splitlines()
    assert line.startswith("error: ") and len(line) <= 300 and "Traceback" not in result.output
    return line


def model(root: Path) -> Path:
    """A directory with its manifest, written by the merge's own writer; a checkpoint file
    beside it recorded as the source."""
    out = root / "merged"
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}" + b" " * 6)
    write_manifest(out, Digests())
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"meta")
    doc = manifest(out)
    doc["source"] = [
        {"location": str(ckpt), "format": "dcp", "files": [file_entry(ckpt / ".metadata")]}
    ]
    rewrite(out, doc)
    return out


def file_entry(path: Path, name: str | None = None, algo: str = "sha256") -> dict[str, Any]:
    """An entry of `source` (SHA-256), or with `algo` "blake3" of the output's `files`."""
    data = path.read_bytes()
    digest = blake3.blake3(data) if algo == "blake3" else hashlib.sha256(data)
    return {"path": name or path.name, "size": len(data), algo: digest.hexdigest()}


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / MANIFEST).read_text())


def rewrite(out: Path, doc: dict[str, Any]) -> None:
    """The manifest as an attacker writes it: its checksum made to match."""
    doc.pop("checksum", None)
    doc["checksum"] = hashlib.sha256(canonical(doc)).hexdigest()
    (out / MANIFEST).write_text(json.dumps(doc))


def test_paths_outside_the_directory_are_refused_before_reading(tmp_path: Path) -> None:
    out = model(tmp_path)
    ckpt = tmp_path / "ckpt"
    assert run(out, "--checkpoint", ckpt).exit_code == 0
    secret = tmp_path / "secret.txt"  # outside both: listed with its true size and hash
    secret.write_text("host-7\n")
    entry, original = file_entry(secret), (out / MANIFEST).read_text()
    listed = file_entry(secret, algo="blake3")
    for name in ("../secret.txt", "../../../../" + str(secret).lstrip("/"), str(secret)):
        doc = json.loads(original)
        doc["files"][name] = {"size": listed["size"], "blake3": listed["blake3"]}
        rewrite(out, doc)
        line = one_error(run(out))
        assert "names a path outside the directory; refusing to read it" in line, line
    doc = json.loads(original)
    doc["source"][0]["files"].append({**entry, "path": "../secret.txt"})
    rewrite(out, doc)
    line = one_error(run(out, "--checkpoint", ckpt))
    assert "entry source[0].files[1].path names a path outside the directory" in line, line


def test_a_symlink_out_of_the_directory_is_refused(tmp_path: Path) -> None:
    out = model(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("host-7\n")
    (out / "notes.txt").symlink_to(secret)
    doc = manifest(out)
    doc["files"]["notes.txt"] = {
        k: v for k, v in file_entry(secret, algo="blake3").items() if k != "path"
    }
    rewrite(out, doc)
    line = one_error(run(out))
    assert (
        line
        == f"error: {out / 'notes.txt'}: resolves outside {out} (a symlink); refusing to read it"
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["files"]["config.json"].update(size="abc"), "files['config.json'].size is 'abc' (str)"),
        (lambda d: d["files"].update({"config.json": [1, 2]}), "files['config.json'] is [1, 2] (list)"),
        (lambda d: d["files"]["config.json"].update(blake3=None), "files['config.json'].blake3 is missing"),
        (lambda d: d["source"][0].update(files="__0_0.distcp"), "source[0].files is '__0_0.distcp'"),
        (lambda d: d["source"][0]["files"][0].update(records=[{"offset": -1}]), "records[0].offset is -1"),
        (lambda d: d.update(source={}), "entry source is {} (dict), not a list"),
    ],
)  # fmt: skip
def test_a_field_of_the_wrong_kind_is_one_line(tmp_path: Path, change: Any, named: str) -> None:
    out = model(tmp_path)
    doc = manifest(out)
    change(doc)
    rewrite(out, doc)
    line = one_error(run(out, "--checkpoint", tmp_path / "ckpt"))
    assert line.startswith(f"error: {out / MANIFEST}: entry "), line
    assert named in line and "not a manifest a shardforge merge wrote" in line, line


def test_deep_nesting_is_refused_before_parsing(tmp_path: Path) -> None:
    out = model(tmp_path)
    deep = 200_000
    (out / MANIFEST).write_text(
        '{"format": "shardforge-manifest", "x": ' + "[" * deep + "]" * deep + "}"
    )
    line = one_error(run(out))
    assert line == (
        f"error: {out / MANIFEST}: nests more than 16 levels deep (a manifest nests 7); "
        "not a manifest a shardforge merge wrote; merge again to get one"
    )
    # brackets inside strings are not nesting: a name may hold them
    other = model(tmp_path / "b")
    doc = manifest(other)
    doc["written_by"] = "[" * 100 + '"\\"{'
    rewrite(other, doc)
    assert run(other).exit_code == 0


def test_a_huge_manifest_is_refused_by_its_size(tmp_path: Path) -> None:
    out = model(tmp_path)
    with (out / MANIFEST).open("r+b") as f:  # sparse: nothing to read, refused unread
        f.truncate(verify_manifest.MAX_MANIFEST_BYTES + 1)
    line = one_error(run(out))
    assert line == (
        f"error: {out / MANIFEST}: 67,108,865 bytes; a manifest is at most 67,108,864 bytes "
        "(about 100 bytes per file and record); refusing to read it"
    )


@pytest.mark.slow
def test_the_same_checks_in_object_storage(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = model(tmp_path)
    bucket = s3_server.bucket("verify-manifest")
    fs = s3_server.fs()
    fs.put(str(out), f"{bucket}/merged", recursive=True)
    for name, value in s3_server.env({}).items():
        monkeypatch.setenv(name, value)
    uri = f"s3://{bucket}/merged"
    assert run(uri).exit_code == 0
    doc = manifest(out)
    doc["files"]["../other/config.json"] = doc["files"]["config.json"]
    rewrite(out, doc)
    fs.put_file(str(out / MANIFEST), f"{bucket}/merged/{MANIFEST}")
    fs.put_file(str(out / "config.json"), f"{bucket}/other/config.json")
    assert "names a path outside the directory" in one_error(run(uri))
    fs.pipe(f"{bucket}/merged/{MANIFEST}", b"[" * 50_000)
    assert "nests more than 16 levels deep" in one_error(run(uri))
    monkeypatch.setattr(verify_manifest, "MAX_MANIFEST_BYTES", 4096)
    fs.pipe(f"{bucket}/merged/{MANIFEST}", b" " * 5000)
    assert one_error(run(uri)) == (
        f"error: {uri}/{MANIFEST}: 5,000 bytes; a manifest is at most 4,096 bytes "
        "(about 100 bytes per file and record); refusing to read it"
    )
