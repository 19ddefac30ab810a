"""Round trips: tiny models sharded with fully_shard over 2 and 3 real gloo ranks, saved with
dcp.save in each layout, merged, and compared bit for bit with the original."""

from __future__ import annotations

import filecmp
import functools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.tiny import make_model
from shardforge.merge.api import merge_fsdp_weights

# hidden 70 (not divisible by 3), vocab 331 and intermediate 101 (divisible by neither 2 nor 3)
SHAPES: dict[str, Any] = {
    "vocab_size": 331,
    "hidden_size": 70,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "intermediate_size": 101,
}
MODELS: dict[str, tuple[str, str]] = {
    "llama-fp32": ("llama", "float32"),
    "llama-bf16": ("llama", "bfloat16"),
    "qwen2-fp32": ("qwen2", "float32"),
    "qwen2-bf16": ("qwen2", "bfloat16"),
}
WORLD_SIZES = (2, 3)
# layouts written for every model; the others for a subset (to keep the suite fast)
EXTRA_LAYOUTS: dict[str, tuple[str, ...]] = {
    "hf-trainer": ("llama-fp32", "qwen2-bf16"),
    "lightning": ("llama-bf16", "qwen2-fp32"),
    "per-item": ("qwen2-bf16",),
    "wrapped": ("llama-bf16",),
}


def wrapped_key(name: str) -> str:
    """A key as torch.compile + activation checkpointing + a `state_dict` wrapper leave it."""
    name = re.sub(r"(layers\.\d+\.)", r"\1_checkpoint_wrapped_module.", name)
    return f"_orig_mod.{name}"


LIGHTNING_ATTR = "model"


def _shard(model: Any, mesh: Any = None) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _optimizer_state(model: Any) -> dict[str, Any]:
    """Real AdamW state (one step with lr=0, so the weights stay as they were)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    model(torch.tensor([[1, 2, 3, 4]])).logits.float().sum().backward()
    opt.step()
    return get_optimizer_state_dict(model, opt)


def save_every_world_size(
    rank: int, world_size: int, bases: dict[str, str], roots: dict[int, str]
) -> None:
    """One launch of the largest world size saves for each smaller one too: its first ranks
    form a process group of that size (a mesh of their own, fully_shard over it, DCP saves
    within it: the files and metadata of a world of that size), the others wait."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    for size, root in sorted(roots.items()):
        assert size <= world_size
        group = None if size == world_size else dist.new_group(list(range(size)))
        if rank < size:
            mesh = None if group is None else DeviceMesh.from_group(group, "cpu")
            save_all(rank, size, bases, root, mesh, group)
        dist.barrier()


def save_all(
    rank: int, world_size: int, bases: dict[str, str], root: str, mesh: Any, group: Any
) -> None:
    """On every rank of `group` (None: the world): shard each base model over `mesh` and save
    it in each layout under root/<model>/."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    assert dist.get_world_size(group) == world_size and dist.get_rank(group) == rank
    for name, base in bases.items():
        out = Path(root) / name
        model = AutoModelForCausalLM.from_pretrained(base)
        _shard(model, mesh)
        sd = get_model_state_dict(model)
        # shardforge: checkpoint-<step>/{model,optimizer,trainer_state.json}
        for step in (2, 4):
            ckpt = out / "shardforge" / f"checkpoint-{step}"
            dcp.save(sd, checkpoint_id=ckpt / "model", process_group=group)
            if rank == 0:
                state = {"format": "shardforge", "format_version": 1, "step": step}
                (ckpt / "trainer_state.json").write_text(json.dumps(state))
        osd = _optimizer_state(model)
        dcp.save(
            osd,
            checkpoint_id=out / "shardforge" / "checkpoint-4" / "optimizer",
            process_group=group,
        )
        if rank == 0:  # in progress / junk: must be ignored
            (out / "shardforge" / "checkpoint-6.tmp-123" / "model").mkdir(parents=True)
            (out / "shardforge" / "checkpoint-8").mkdir()
        if name in EXTRA_LAYOUTS["hf-trainer"]:
            ckpt = out / "hf-trainer" / "checkpoint-3"
            dcp.save(
                {"model": sd}, checkpoint_id=ckpt / "pytorch_model_fsdp_0", process_group=group
            )
            dcp.save({"optimizer": osd}, checkpoint_id=ckpt / "optimizer_0", process_group=group)
        if name in EXTRA_LAYOUTS["lightning"]:
            ckpts = out / "lightning" / "lightning_logs" / "version_0" / "checkpoints"
            for step in (1, 3):
                ckpt = ckpts / f"epoch=0-step={step}.ckpt"
                state = {
                    "model": {f"{LIGHTNING_ATTR}.{k}": v for k, v in sd.items()},
                    "optimizer_0": osd,
                }
                dcp.save(state, checkpoint_id=ckpt, process_group=group)
                if rank == 0:
                    meta = {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.5.0"}
                    torch.save(meta, ckpt / "meta.pt")
        if name in EXTRA_LAYOUTS["wrapped"]:
            state = {"state_dict": {wrapped_key(k): v for k, v in sd.items()}}
            dcp.save(state, checkpoint_id=out / "wrapped", process_group=group)
        if name in EXTRA_LAYOUTS["per-item"]:
            writer = FileSystemWriter(out / "per-item", single_file_per_rank=False)
            dcp.save(sd, storage_writer=writer, process_group=group)
        dist.barrier(group)


@dataclass(frozen=True)
class Built:
    root: Path
    bases: dict[str, Path]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("merge")
    bases = {
        name: make_model(root / "bases" / name, mt, dtype=dt, seed=i, **SHAPES)
        for i, (name, (mt, dt)) in enumerate(MODELS.items())
    }
    roots = {ws: str(root / f"ws{ws}") for ws in WORLD_SIZES}
    run_on_ranks(
        save_every_world_size, max(WORLD_SIZES), {k: str(v) for k, v in bases.items()}, roots
    )
    return Built(root, bases)


def _cfg(built: Built, model: str, output_dir: Path) -> dict[str, Any]:
    return {"base_model": str(built.bases[model]), "output_dir": str(output_dir)}


@functools.cache
def _reference(base: Path, dtype: torch.dtype | None) -> Any:
    """The original model, loaded once per base and dtype (the tests only read it).
    dtype: loaded cast (as from_pretrained casts), so buffers match the merged model's."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=dtype or "auto").eval()


def assert_same_model(base: Path, merged: Path, dtype: torch.dtype | None = None) -> None:
    """Loads with from_pretrained; every tensor bit-identical; logits equal; tokenizer loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = _reference(base, dtype)
    got = AutoModelForCausalLM.from_pretrained(merged).eval()
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for k in ref_sd:
        assert ref_sd[k].dtype == got_sd[k].dtype, k
        assert torch.equal(ref_sd[k], got_sd[k]), k
    ids = torch.tensor([[1, 5, 9, 17, 33, 100, 250, 330]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    tok = AutoTokenizer.from_pretrained(merged)
    assert tok.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    config = json.loads((merged / "config.json").read_text())
    assert not config["architectures"][0].startswith("FSDP")
    assert (merged / "generation_config.json").is_file()
    assert not list(merged.parent.glob(f".{merged.name}.*"))  # no temp sibling left


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("model", list(MODELS))
def test_round_trip_shardforge_layout(built: Built, model: str, ws: int, tmp_path: Path) -> None:
    out_dir = built.root / f"ws{ws}" / model / "shardforge"
    merged = merge_fsdp_weights(_cfg(built, model, out_dir), tmp_path / "merged", quiet=True)
    assert_same_model(built.bases[model], merged)
    # the same bytes save_pretrained wrote for the original model
    assert filecmp.cmp(built.bases[model] / "model.safetensors", merged / "model.safetensors")
    if MODELS[model][0] == "qwen2":  # tied: stored once, as save_pretrained does
        from safetensors import safe_open

        with safe_open(str(merged / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in list(f.keys())


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("model", EXTRA_LAYOUTS["hf-trainer"])
def test_round_trip_hf_trainer_layout(built: Built, model: str, ws: int, tmp_path: Path) -> None:
    out_dir = built.root / f"ws{ws}" / model / "hf-trainer"
    merged = merge_fsdp_weights(
        _cfg(built, model, out_dir), tmp_path / "merged", quiet=True, verify=True
    )
    assert_same_model(built.bases[model], merged)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("model", EXTRA_LAYOUTS["lightning"])
def test_round_trip_lightning_layout(
    built: Built, model: str, ws: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out_dir = built.root / f"ws{ws}" / model / "lightning"
    with caplog.at_level("INFO", logger="shardforge"):
        merged = merge_fsdp_weights(_cfg(built, model, out_dir), tmp_path / "merged", quiet=True)
    assert "epoch=0-step=3.ckpt" in caplog.text  # highest step chosen and printed
    assert_same_model(built.bases[model], merged)


def test_round_trip_per_item_files(built: Built, tmp_path: Path) -> None:
    model = EXTRA_LAYOUTS["per-item"][0]
    ckpt = built.root / "ws3" / model / "per-item"
    assert len(list(ckpt.glob("*.distcp"))) > 3
    merged = merge_fsdp_weights(
        _cfg(built, model, tmp_path / "unused"), tmp_path / "merged", checkpoint=ckpt, quiet=True
    )
    assert_same_model(built.bases[model], merged)


def test_round_trip_wrapper_prefixes(built: Built, tmp_path: Path) -> None:
    model = EXTRA_LAYOUTS["wrapped"][0]
    ckpt = built.root / "ws2" / model / "wrapped"
    merged = merge_fsdp_weights(
        _cfg(built, model, tmp_path / "unused"), tmp_path / "merged", checkpoint=ckpt, quiet=True
    )
    assert_same_model(built.bases[model], merged)


def test_latest_complete_checkpoint_is_chosen_and_step_picks(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out_dir = built.root / "ws2" / "llama-fp32" / "shardforge"
    cfg = _cfg(built, "llama-fp32", out_dir)
    with caplog.at_level("INFO", logger="shardforge"):
        merge_fsdp_weights(cfg, tmp_path / "a", quiet=True, save_tokenizer=False)
    assert "checkpoint-4" in caplog.text  # checkpoint-8 (incomplete) and the .tmp dir ignored
    assert not (tmp_path / "a" / "tokenizer.json").exists()
    caplog.clear()
    with caplog.at_level("INFO", logger="shardforge"):
        merge_fsdp_weights(cfg, tmp_path / "b", quiet=True, step=2)
    assert "checkpoint-2" in caplog.text


@pytest.mark.parametrize("model", ["llama-fp32", "qwen2-bf16"])
def test_engines_write_identical_tensors(built: Built, model: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out_dir = built.root / "ws3" / model / "hf-trainer"
    cfg = _cfg(built, model, out_dir)
    a = merge_fsdp_weights(cfg, tmp_path / "stream", quiet=True)
    b = merge_fsdp_weights(cfg, tmp_path / "hf", quiet=True, engine="transformers", verify=True)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def test_dtype_cast_while_streaming(built: Built, tmp_path: Path) -> None:
    out_dir = built.root / "ws3" / "llama-fp32" / "shardforge"
    merged = merge_fsdp_weights(
        _cfg(built, "llama-fp32", out_dir), tmp_path / "m", dtype="bf16", verify=True, quiet=True
    )
    assert_same_model(built.bases["llama-fp32"], merged, dtype=torch.bfloat16)
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    # the next merge in this process (the architecture is cached) keeps the stored dtype: the
    # cast set the dtype on a copy of the config, not on the cached one
    plain = merge_fsdp_weights(_cfg(built, "llama-fp32", out_dir), tmp_path / "p", quiet=True)
    assert json.loads((plain / "config.json").read_text())["dtype"] == "float32"
    assert filecmp.cmp(built.bases["llama-fp32"] / "model.safetensors", plain / "model.safetensors")


def test_sharded_output_matches_save_pretrained(built: Built, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = "qwen2-fp32"
    out_dir = built.root / "ws2" / model / "shardforge"
    merged = merge_fsdp_weights(
        _cfg(built, model, out_dir), tmp_path / "m", max_shard_size="60KB", quiet=True
    )
    ref = tmp_path / "ref"
    AutoModelForCausalLM.from_pretrained(built.bases[model]).save_pretrained(
        ref, max_shard_size="60KB"
    )
    index = "model.safetensors.index.json"
    assert json.loads((merged / index).read_text()) == json.loads((ref / index).read_text())
    shards = sorted(p.name for p in ref.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert sorted(p.name for p in merged.glob("model-*.safetensors")) == shards
    for name in shards:
        assert filecmp.cmp(ref / name, merged / name, shallow=False), name
    assert_same_model(built.bases[model], merged)


def test_remove_checkpoint_dir_after_verification(built: Built, tmp_path: Path) -> None:
    src = built.root / "ws2" / "llama-bf16" / "shardforge" / "checkpoint-2"
    work = tmp_path / "run"
    shutil.copytree(src, work / "checkpoint-2")
    merged = merge_fsdp_weights(
        _cfg(built, "llama-bf16", work), tmp_path / "m", remove_checkpoint_dir=True, quiet=True
    )
    assert not (work / "checkpoint-2" / "model").exists()
    assert (work / "checkpoint-2" / "trainer_state.json").exists()
    assert_same_model(built.bases["llama-bf16"], merged)


def test_fsdp_prefix_removed_from_architectures(built: Built, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(built.bases["llama-fp32"], base)
    config = json.loads((base / "config.json").read_text())
    config["architectures"] = ["FSDPLlamaForCausalLM"]
    (base / "config.json").write_text(json.dumps(config))
    out_dir = built.root / "ws2" / "llama-fp32" / "shardforge"
    merged = merge_fsdp_weights(
        {"base_model": str(base), "output_dir": str(out_dir)}, tmp_path / "m", quiet=True
    )
    written = json.loads((merged / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]


def _mixed_dtype_checkpoint(built: Built, root: Path) -> Path:
    """A plain DCP of llama-fp32 whose matrices are bf16 and whose norms stay float32 (as
    mixed-precision training keeps them), written by torch DCP in one process."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    sd = load_file(built.bases["llama-fp32"] / "model.safetensors")
    mixed = {k: v if v.ndim < 2 else v.to(torch.bfloat16) for k, v in sd.items()}
    dcp.save(mixed, checkpoint_id=root / "mixed", no_dist=True)
    return root / "mixed"


def test_the_transformers_engine_keeps_each_tensors_dtype(built: Built, tmp_path: Path) -> None:
    """Bug: --engine transformers built the model in one dtype, so with --dtype as_saved a
    mixed-dtype checkpoint came out unlike the streaming engine's."""
    from safetensors.torch import load_file

    ckpt = _mixed_dtype_checkpoint(built, tmp_path)
    cfg = _cfg(built, "llama-fp32", tmp_path / "run")
    kw: dict[str, Any] = {"checkpoint": ckpt, "dtype": "as_saved", "quiet": True}
    a = merge_fsdp_weights(cfg, tmp_path / "stream", **kw)
    b = merge_fsdp_weights(cfg, tmp_path / "hf", engine="transformers", verify=True, **kw)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert {t.dtype for t in ta.values()} == {torch.float32, torch.bfloat16}
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def test_every_published_file_is_fsynced_before_the_rename(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: the index, config.json, generation_config.json and tokenizer files were renamed
    into place without an fsync (only the weights and the directories were)."""
    import os

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out_dir = built.root / "ws2" / "qwen2-fp32" / "shardforge"
    merged = merge_fsdp_weights(
        _cfg(built, "qwen2-fp32", out_dir), tmp_path / "m", max_shard_size="60KB", quiet=True
    )
    hidden = {Path(p).name for p in synced if "/.m.tmp-" in p}
    written = {p.name for p in merged.iterdir()}
    assert "model.safetensors.index.json" in written and "tokenizer.json" in written
    assert written <= hidden, sorted(written - hidden)


def test_a_broken_generation_config_is_reported_not_skipped(
    built: Built, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: any error reading generation_config.json was swallowed and the file silently
    left out of the merged model."""
    base = tmp_path / "base"
    shutil.copytree(built.bases["llama-fp32"], base)
    (base / "generation_config.json").write_text("{not json")
    out_dir = built.root / "ws2" / "llama-fp32" / "shardforge"
    cfg = {"base_model": str(base), "output_dir": str(out_dir)}
    with caplog.at_level("WARNING", logger="shardforge"):
        merged = merge_fsdp_weights(cfg, tmp_path / "m", quiet=True)
    assert not (merged / "generation_config.json").exists()
    assert any(
        "generation_config.json" in r.getMessage() and "not copied" in r.getMessage()
        for r in caplog.records
    ), caplog.text


def test_a_failing_weight_conversion_check_names_its_cause(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: any failure of transformers' weight conversion tables became advice to use
    --engine transformers, hiding the real error."""
    mapping = pytest.importorskip("transformers.conversion_mapping")
    from shardforge.errors import MergeError
    from shardforge.merge import prepare as api

    def broken(model: Any, **_: Any) -> Any:
        raise RuntimeError("conversion table is broken")

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", broken)
    api._architecture.cache_clear()
    out_dir = built.root / "ws2" / "llama-bf16" / "shardforge"
    try:
        with pytest.raises(MergeError) as info:
            merge_fsdp_weights(_cfg(built, "llama-bf16", out_dir), tmp_path / "m", quiet=True)
    finally:
        api._architecture.cache_clear()
    assert "conversion table is broken" in info.value.message
    assert "--engine transformers" not in info.value.message


@pytest.mark.parametrize("remove", [False, True])
def test_relative_paths_merge_verify_and_remove(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remove: bool
) -> None:
    """`make demo`'s spelling: output_dir and output_path relative to the working directory.
    The DCP metadata is parsed once per merge (cached by its absolute path); the manifest's
    source identity and the shard removal name its files relative to the folder however it
    was spelled (the manifest failed with a ValueError of pathlib after the merge)."""
    src = built.root / "ws2" / "llama-fp32" / "shardforge" / "checkpoint-4"
    shutil.copytree(src, tmp_path / "run" / "checkpoint-4")
    monkeypatch.chdir(tmp_path)
    cfg = {"base_model": str(built.bases["llama-fp32"]), "output_dir": "run"}
    merged = merge_fsdp_weights(
        cfg, "merged", quiet=True, verify=True, remove_checkpoint_dir=remove
    )
    assert (tmp_path / "run" / "checkpoint-4" / "model").exists() is not remove
    assert (tmp_path / "run" / "checkpoint-4" / "optimizer").is_dir()  # not the model's shards
    manifest = json.loads((tmp_path / "merged" / "shardforge-manifest.json").read_text())
    (source,) = manifest["source"]
    assert source["location"] == str(tmp_path / "run" / "checkpoint-4" / "model")
    names = sorted(f["path"] for f in source["files"])
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert_same_model(built.bases["llama-fp32"], tmp_path / Path(merged))
