"""FULL_STATE_DICT's final save: the model's dtypes, and nothing half-written is ever visible.

The shards are written in hidden temporary places inside output_dir, fsynced, then published
(renamed) into it, the index last; an interrupted save leaves output_dir as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from helpers.dist import run_on_ranks
from helpers.tiny import make_model
from shardforge.train.full_save import save_full_model

INT_BUFFER = torch.tensor([3, -7, 2**40 + 1, 0], dtype=torch.int64)
BOOL_BUFFER = torch.tensor([True, False, True])
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("full") / "base", "llama", vocab_size=331)


def _model_with_buffers(rank: int, world_size: int, base: str) -> tuple[torch.nn.Module, Any]:
    """The base model sharded over the ranks (float32), with an integer and a bool buffer, and
    a config that asks for bfloat16."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardforge.config import validate_cfg
    from shardforge.train.model import build_meta_model, materialize_and_load, shard_model

    cfg = validate_cfg({"base_model": base})
    model = build_meta_model(cfg)
    shard_model(model, cfg, init_device_mesh("cpu", (world_size,)))
    materialize_and_load(model, cfg, torch.device("cpu"), rank)
    model.register_buffer("step_count", INT_BUFFER.clone())
    model.model.register_buffer("keep", BOOL_BUFFER.clone())
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.dtype = torch.bfloat16
    return model, config


def _save(rank: int, world_size: int, base: str, out: str, shard_size: str) -> None:
    model, config = _model_with_buffers(rank, world_size, base)
    save_full_model(Path(out), model, config, max_shard_size=shard_size)


def _read(out: Path) -> dict[str, torch.Tensor]:
    names = (
        json.loads((out / INDEX).read_text())["weight_map"].values()
        if (out / INDEX).is_file()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(names)):
        with safe_open(str(out / name), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


def _both(rank: int, world_size: int, base: str, root: str) -> None:
    """The saves of both tests below, in one launch of ranks."""
    _save(rank, world_size, base, f"{root}/buffers", "40KB")
    _interrupted(rank, world_size, base, f"{root}/interrupted")


@pytest.fixture(scope="module")
def on_two_ranks(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The saves of 2 gloo ranks: buffers/ (`_save`) and interrupted/ (`_interrupted`, its
    output_dirs each holding a config.json first)."""
    root = tmp_path_factory.mktemp("two-ranks")
    (root / "buffers").mkdir()  # the run's output_dir, made when training starts
    for earlier in EARLIER:
        (root / "interrupted" / (earlier or "fresh")).mkdir(parents=True)
        (root / "interrupted" / (earlier or "fresh") / "config.json").write_text("{}")
    run_on_ranks(_both, 2, str(base), str(root))
    return root


@pytest.mark.slow
def test_integer_and_bool_buffers_keep_their_dtype_and_values(
    base: Path, on_two_ranks: Path
) -> None:
    from transformers import AutoModelForCausalLM

    saved = _read(on_two_ranks / "buffers")
    assert saved["step_count"].dtype == torch.int64 and torch.equal(saved["step_count"], INT_BUFFER)
    assert saved["model.keep"].dtype == torch.bool and torch.equal(saved["model.keep"], BOOL_BUFFER)
    reference = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for key, tensor in reference.items():  # floating tensors: in the config's dtype
        assert saved[key].dtype == torch.bfloat16, key
        assert torch.equal(saved[key], tensor.to(torch.bfloat16)), key


def _listing(out: Path) -> dict[str, str]:
    """Every entry of `out` (hidden ones too): a file's sha256, a folder's name with a slash."""
    import hashlib

    return {
        p.name + ("/" if p.is_dir() else ""): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else ""
        for p in sorted(out.iterdir())
    }


def _interrupted(rank: int, world_size: int, base: str, root: str) -> None:
    """For each earlier state of output_dir (none; a complete sharded save; a single-file
    one), a save with an error injected on every rank once its first shard is complete. Rank 0
    reports what output_dir held before the save, the shards it wrote, the error, and what
    output_dir holds after."""
    model, config = _model_with_buffers(rank, world_size, base)
    reports = {}
    for earlier in EARLIER:
        out = Path(root) / (earlier or "fresh")
        if earlier:
            save_full_model(out, model, config, max_shard_size=earlier)
        before = _listing(out) if rank == 0 else {}
        written, error = _save_stopping_after_first_shard(out, model, config)
        after = _listing(out) if rank == 0 else {}
        reports[earlier] = {"before": before, "written": written, "error": error, "after": after}
    if rank == 0:
        (Path(root) / "report.json").write_text(json.dumps(reports))


def _save_stopping_after_first_shard(
    out: Path, model: torch.nn.Module, config: Any
) -> tuple[list[str], str | None]:
    """Save with an error injected once the first shard is complete (this process only): the
    shards written and the error."""
    import safetensors.torch

    real = safetensors.torch.save_file
    written: list[str] = []

    def save_file(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        if written:
            raise RuntimeError("injected: the save stops after its first shard")
        real(tensors, filename, **kwargs)
        written.append(filename)

    safetensors.torch.save_file = save_file
    try:
        save_full_model(out, model, config, max_shard_size="40KB")
    except RuntimeError as exc:
        return written, str(exc)
    finally:
        safetensors.torch.save_file = real
    return written, None


# max_shard_size of an earlier complete save in output_dir ("": none)
EARLIER = ("", "100KB", "5GB")


@pytest.mark.slow
def test_an_interrupted_save_leaves_output_dir_as_it_was(on_two_ranks: Path) -> None:
    """The error comes after the first shard was complete on disk: output_dir holds no index and
    no shard of this save (nor a hidden temporary); an earlier complete save is intact."""
    reports = json.loads((on_two_ranks / "interrupted" / "report.json").read_text())
    for earlier, report in reports.items():
        assert report["error"] is not None and "injected" in report["error"], earlier
        assert len(report["written"]) == 1, earlier  # the first shard was complete, then it stopped
        assert report["after"] == report["before"], earlier
    assert list(reports[""]["after"]) == ["config.json"]
    assert INDEX in reports["100KB"]["after"] and "model.safetensors" in reports["5GB"]["after"]


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {f"layers.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(5)}
    return {**out, "layers.0.count": torch.arange(7)}


def test_every_file_is_fsynced_before_it_is_published_and_the_index_comes_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded save over an earlier single-file one: each file is complete and fsynced in a
    hidden place before its rename; the earlier save's files go before any new one appears;
    output_dir is fsynced after the shards' renames and before the index appears."""
    from shardforge.io import publish
    from shardforge.train.full_save import write_hf_weights

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"an earlier save")
    (out / "model-00001-of-00009.safetensors").write_bytes(b"an earlier shard")
    events: list[tuple[str, str]] = []
    real_fsync, real_publish = os.fsync, publish._publish_file

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def publish_file(written: Path, dest: Path, overwrite: bool) -> None:
        stale = sorted(p.name for p in out.glob("model*.safetensors") if p.stat().st_size < 99)
        events.append(("publish", dest.name if not stale else f"{dest.name} beside {stale}"))
        real_publish(written, dest, overwrite)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(publish, "_publish_file", publish_file)
    files = write_hf_weights(out, _tensors(), "40KB")

    shards = files[:-1]
    assert len(shards) > 1 and files[-1] == INDEX
    assert [name for kind, name in events if kind == "publish"] == files
    for name in files:
        synced = events.index(next(e for e in events if e[0] == "fsync" and e[1].endswith(name)))
        assert f"/.{name}.tmp-" in events[synced][1]  # written in a hidden temporary place
        assert synced < events.index(("publish", name))
    last_shard, index = events.index(("publish", shards[-1])), events.index(("publish", INDEX))
    assert ("fsync", str(out)) in events[last_shard:index]
    assert sorted(os.listdir(out)) == sorted(["config.json", *files])
    saved = _read(out)
    assert saved.keys() == _tensors().keys()
    assert all(torch.equal(t, _tensors()[k]) for k, t in saved.items())

    # a single-file save over the sharded one: the index goes first, then the old shards
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert write_hf_weights(out, _tensors(), "5GB") == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    saved = _read(out)
    assert saved.keys() == _tensors().keys()
    assert all(torch.equal(t, _tensors()[k]) for k, t in saved.items())
