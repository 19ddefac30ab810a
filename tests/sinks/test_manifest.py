"""Every output directory carries `shardforge-manifest.json` (version 2): the BLAKE3 (or, asked
for, SHA-256) of each file, the weights hashed from their written bytes behind the copy (never by
a whole-file read afterwards), and the identity of the checkpoint read. Checkpoints: the 3-rank ones of `test_inspection` (DCP and rank files), merged by each
path (the early copy with and without gaps, no early copy, sharded, the transformers engine),
and a PEFT adapter fused by merge-lora."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

import shardforge.merge.overlap as overlap
import shardforge.sinks.manifest as manifest
from shardforge.merge.api import merge_fsdp_weights
from shardforge.sinks.manifest import MANIFEST
from test_inspection import Built, build_checkpoints

# the checkpoints are written by gloo ranks (build_checkpoints)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_checkpoints(tmp_path_factory)


@pytest.fixture
def read_back(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the manifest hashed by reading them (every other was hashed as written)."""
    seen: list[str] = []
    real = manifest.hash_file

    def record(path: Path, algo: str) -> str:
        seen.append(path.name)
        return real(path, algo)

    monkeypatch.setattr(manifest, "hash_file", record)
    return seen


def digest(data: bytes, algo: str = "blake3") -> str:
    """What `b3sum` (or `sha256sum`) prints for `data`."""
    return blake3.blake3(data).hexdigest() if algo == "blake3" else hashlib.sha256(data).hexdigest()


def check_manifest(out: Path, algo: str = "blake3") -> dict[str, Any]:
    """The manifest lists every other file of `out` with its `algo` digest and its size."""
    doc = json.loads((out / MANIFEST).read_text())
    assert doc["format"] == "shardforge-manifest" and doc["version"] == 2
    assert doc["hash"] == algo
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(doc["files"]) == [n for n in on_disk if n != MANIFEST]
    for name, entry in doc["files"].items():
        data = (out / name).read_bytes()
        assert entry == {"size": len(data), algo: digest(data, algo)}, name
    rest = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    assert doc["checksum"] == hashlib.sha256(text).hexdigest()
    return doc


def check_dcp_source(entry: dict[str, Any], model_dir: Path) -> None:
    """Each record's CRC-32 is the one Python's zipfile reads there; `.metadata` by SHA-256."""
    assert entry["format"] == "dcp" and Path(entry["location"]) == model_dir.absolute()
    files = {f["path"]: f for f in entry["files"]}
    meta = (model_dir / ".metadata").read_bytes()
    assert files.pop(".metadata") == {
        "path": ".metadata",
        "size": len(meta),
        "sha256": hashlib.sha256(meta).hexdigest(),
    }
    assert sorted(files) == sorted(p.name for p in model_dir.glob("*.distcp"))
    for name, f in files.items():
        data = (model_dir / name).read_bytes()
        assert f["size"] == len(data) and f["records"]
        for r in f["records"]:
            with zipfile.ZipFile(io.BytesIO(data[r["offset"] : r["offset"] + r["length"]])) as z:
                assert r["crc32"] == {m: z.getinfo(m).CRC for m in r["crc32"]}
                assert len(r["crc32"]) == 1 and next(iter(r["crc32"])).endswith("data/0")


def _cfg(built: Built, tmp_path: Path) -> dict[str, Any]:
    return {"base_model": str(built.base), "output_dir": str(tmp_path / "run")}


def _early(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("early copy")]


CASES: dict[str, dict[str, Any]] = {
    "early copy, no gap": {},
    "early copy with gaps": {"dtype": "bf16", "keep_dtype": ["norm"]},
    "no early copy": {},
    "sharded, cast": {"max_shard_size": "60KB", "dtype": "bfloat16"},
    "transformers engine": {"engine": "transformers"},
    "sha256": {"manifest_hash": "sha256"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_merge_writes_a_manifest_hashed_as_it_wrote(
    built: Built,
    case: str,
    tmp_path: Path,
    read_back: list[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if case == "no early copy":
        monkeypatch.setattr(overlap, "ENABLED", False)
    model_dir = built.ours / "checkpoint-4" / "model"
    with caplog.at_level(logging.DEBUG, logger="shardforge"):
        out = merge_fsdp_weights(
            _cfg(built, tmp_path), tmp_path / "merged", checkpoint=model_dir, quiet=True,
            **CASES[case],
        )  # fmt: skip
    doc = check_manifest(out, CASES[case].get("manifest_hash", "blake3"))
    weights = sorted(n for n in doc["files"] if n.endswith(".safetensors"))
    assert weights and ("model.safetensors" in weights) == ("max_shard_size" not in CASES[case])
    if case == "transformers engine":  # save_pretrained's files: hashed once written
        assert set(weights) <= set(read_back)
    else:  # the weights were hashed as they were written, never read again
        assert not set(weights) & set(read_back), read_back
    assert "config.json" in read_back and "tokenizer.json" in read_back
    if case.startswith("early copy"):
        accepted = [o for o in _early(caplog) if o.startswith("early copy accepted")]
        assert accepted and not accepted[0].endswith(": 0 tensors copied"), _early(caplog)
    (source,) = doc["source"]
    check_dcp_source(source, model_dir)


def test_rank_files_are_identified_by_their_records_crcs(built: Built, tmp_path: Path) -> None:
    actor = built.root / "verl" / "global_step_3" / "actor"
    out = merge_fsdp_weights(_cfg(built, tmp_path), tmp_path / "m", checkpoint=actor, quiet=True)
    (source,) = check_manifest(out)["source"]
    assert source["format"] == "rank-files" and Path(source["location"]) == actor
    assert [f["path"] for f in source["files"]] == [
        f"model_world_size_3_rank_{r}.pt" for r in range(3)
    ]
    for f in source["files"]:
        (record,) = f["records"]
        assert (record["offset"], record["length"]) == (0, f["size"])
        with zipfile.ZipFile(actor / f["path"]) as z:
            stored = {i.filename: i.CRC for i in z.infolist()}
        assert record["crc32"] == stored


def test_merge_lora_and_without_a_manifest(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """merge-lora's directory has one too (the base model's safetensors files identified by
    size and, being small, SHA-256); turned off, nothing is hashed and the bytes are the same."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardforge.merge.lora import merge_lora

    pm = get_peft_model(
        AutoModelForCausalLM.from_pretrained(built.base),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]),
    )
    pm.save_pretrained(tmp_path / "adapter")
    cfg = {**_cfg(built, tmp_path), "lora_model_dir": str(tmp_path / "adapter")}
    out = merge_lora(cfg, tmp_path / "fused", quiet=True)
    doc = check_manifest(out)
    locations = {Path(s["location"]): s for s in doc["source"]}
    base = locations[built.base / "model.safetensors"]
    data = (built.base / "model.safetensors").read_bytes()
    assert base["files"] == [
        {"path": "model.safetensors", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    ]
    assert tmp_path / "adapter" / "adapter_model.safetensors" in locations
    monkeypatch.setattr(manifest, "ENABLED", False)
    plain = merge_lora(cfg, tmp_path / "plain", quiet=True)
    assert not (plain / MANIFEST).exists()
    for name in doc["files"]:
        assert (plain / name).read_bytes() == (out / name).read_bytes(), name


def test_an_adapter_directory_has_one(built: Built, tmp_path: Path) -> None:
    """The PEFT adapter sink: its weights renamed after writing keep the hash written."""
    from shardforge.formats.registry import open_checkpoint
    from shardforge.sinks.base import Output, WriteOptions
    from shardforge.sinks.hf_dir import AdapterDirectorySink
    from shardforge.sinks.plan import TensorSpec

    model_dir = built.ours / "checkpoint-4" / "model"
    named = open_checkpoint("dcp", model_dir)
    sources = {k: n.source for k, n in list(named.items())[:4]}
    specs = [TensorSpec(k, s.dtype, s.shape) for k, s in sources.items()]
    sink = AdapterDirectorySink()
    output = Output(sink.plan(specs, None, 0), sources, adapter_config={"peft_type": "LORA"})
    sink.write(output, tmp_path / "adapter", WriteOptions(quiet=True))
    doc = check_manifest(tmp_path / "adapter")
    assert sorted(doc["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    with torch.no_grad():
        from safetensors.torch import load_file

        loaded = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert loaded.keys() == sources.keys()


def test_an_early_copy_after_a_gap_is_hashed_from_the_output_once_filled(
    tmp_path: Path, read_back: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor the early copy leaves to the merge (stored strided: through memory) lies
    before others it copied in the kernel: the hash stops at the gap and reads those from the
    output once the merge has written it (never from their source, never by a whole-file read
    afterwards)."""
    from helpers.keep import STRIDED, make_keep_checkpoint
    from shardforge.io.digest import FileHash

    stopped: list[int] = []
    real = FileHash.written

    def spy(self: FileHash, offset: int, n: int) -> None:
        real(self, offset, n)
        stopped.append(self.frontier)

    monkeypatch.setattr(FileHash, "written", spy)
    base, ckpt = make_keep_checkpoint(tmp_path)
    cfg = {"base_model": str(base), "output_dir": str(tmp_path / "run")}
    out = merge_fsdp_weights(
        cfg, tmp_path / "m", checkpoint=ckpt, dtype="as_saved", quiet=True, save_tokenizer=False
    )
    doc = check_manifest(out)
    assert "model.safetensors" in doc["files"] and "model.safetensors" not in read_back
    raw = (out / "model.safetensors").read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:start])
    gap = header[STRIDED]["data_offsets"]
    # the early copy's writes after the gap left the written frontier at the gap
    assert stopped.count(start + gap[0]) > 5
