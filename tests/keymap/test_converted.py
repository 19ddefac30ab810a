"""Saved tensors from in-memory sources (`keymap.converted`), and the whole merge of MoE and
quantized checkpoints with the stream engine.

The sources: an expert slice is its fused tensor's byte range (file slabs where the fused tensor
has them), other boxes and transformers-run groups read their inputs once for all outputs. The
merges (checkpoints from `helpers.moe`, written by 2 gloo ranks with FSDP2 and DCP): fused
experts, FP8 weights with their scales and an int64 buffer, MXFP4 blocks and scales each merge
to the very file ``save_pretrained`` writes, load with transformers (which dequantizes FP8 and
MXFP4 on the CPU) and give the same logits; ``--dtype bfloat16`` casts only the plain floats."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.moe import CONFIGS, config, logits, moe_checkpoints
from shardforge.formats.registry import open_checkpoint
from shardforge.io.copy import ReadCache
from shardforge.keymap.conversion import SavedLayout, Slice, saved_layout
from shardforge.keymap.converted import ConvertedSource, SharedValue, SliceSource, saved_sources
from shardforge.merge.api import merge_fsdp_weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _fused(tmp_path: Path) -> tuple[torch.Tensor, Any]:
    fused = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)
    save_file({"fused": fused}, str(tmp_path / "model.safetensors"))
    return fused, open_checkpoint("safetensors", tmp_path)["fused"].source


def test_an_expert_slice_is_its_byte_range(tmp_path: Path) -> None:
    fused, inner = _fused(tmp_path)
    cut = Slice("fused", (2, 3, 0), (1, 3, 5), (3, 5))
    source = SliceSource(inner, cut, SharedValue(1))
    with ReadCache() as reader:
        slabs = source.slabs(reader)
        assert slabs is not None and [(s.nbytes, s.dst_offset) for s in slabs] == [(60, 0)]
        assert slabs[0].src_offset == inner.slabs(reader)[0].src_offset + (2 * 30 + 15) * 4
        assert torch.equal(source.read(reader), fused[2, 3:])
    assert torch.equal(source.combine([fused]), fused[2, 3:])


def test_other_boxes_read_their_source_once(tmp_path: Path) -> None:
    fused, inner = _fused(tmp_path)
    shared = SharedValue(2)
    cuts = [Slice("fused", (0, 0, c), (4, 6, 1), (4, 6)) for c in (1, 3)]
    sources = [SliceSource(inner, cut, shared) for cut in cuts]
    with ReadCache() as reader:
        assert all(s.slabs(reader) is None for s in sources)
        first = sources[0].read(reader)
        assert shared.value is not None  # kept for the other slice
        second = sources[1].read(reader)
        assert shared.value is None  # dropped after the last
    assert torch.equal(first, fused[:, :, 1]) and torch.equal(second, fused[:, :, 3])


def test_groups_transformers_runs_are_converted_once(tmp_path: Path) -> None:
    """hrm_text saves gate and up concatenated (a many-to-one group)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.for_model(
        "hrm_text", hidden_size=32, intermediate_size=32, num_attention_heads=4, vocab_size=64
    )
    model = AutoModelForCausalLM.from_config(config)
    layout = saved_layout(model, model.state_dict())  # float32, as built
    assert isinstance(layout, SavedLayout)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))  # the checkpoint: bfloat16
    by_memory = {k: n.source for k, n in open_checkpoint("safetensors", tmp_path).items()}
    made = saved_sources(layout, by_memory)
    saved = revert_weight_conversion(model, dict(state))
    assert list(made) == list(saved)
    converted = [s for s in made.values() if isinstance(s, ConvertedSource)]
    assert converted and all(s.slabs(ReadCache()) is None for s in converted)
    with ReadCache() as reader:
        for name, source in made.items():
            assert source.dtype == torch.bfloat16, name
            assert torch.equal(_bits(source.read(reader)), _bits(saved[name])), name
    # a group is taken whole or not at all
    partial = {k: v for k, v in by_memory.items() if not k.endswith("mlp.up_proj.weight")}
    assert not any(n.endswith("gate_up_proj.weight") for n in saved_sources(layout, partial))


# ----------------------------------------------------------------- whole merges (gloo x2)


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_checkpoints(tmp_path_factory)


def _merge(root: Path, name: str, out: Path, **options: Any) -> Path:
    cfg = {"base_model": str(root / name / "base"), "output_dir": str(root / name)}
    return merge_fsdp_weights(cfg, out, checkpoint=root / name / "model", quiet=True, **options)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_merges_to_what_save_pretrained_writes(moe_root: Path, name: str, tmp_path: Path) -> None:
    out = _merge(moe_root, name, tmp_path / "merged", verify=True)
    base = moe_root / name / "base"
    assert (out / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    merged = load_file(out / "model.safetensors")
    dtypes = {str(t.dtype) for t in merged.values()}
    assert {
        "qwen3_moe": {"torch.float32"},
        "fp8": {"torch.float32", "torch.float8_e4m3fn", "torch.int64"},
        "mxfp4": {"torch.float32", "torch.uint8"},
    }[name] == dtypes
    if name != "mxfp4":  # fused in memory, saved per expert
        assert not any(k.endswith("experts.gate_up_proj") for k in merged)
    assert torch.equal(logits(out), logits(base))


def _kept_in_float32(name: str) -> re.Pattern[str] | None:
    """The names the model class keeps in float32, matched by transformers' own glob rule."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import build_glob_alternation

    cls = AutoModelForCausalLM._model_mapping[type(config(name))]
    modules = [*(cls._keep_in_fp32_modules or ()), *(cls._keep_in_fp32_modules_strict or ())]
    return build_glob_alternation(modules)[0] if modules else None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_a_cast_keeps_quantized_weights_scales_and_integers(
    moe_root: Path, name: str, tmp_path: Path
) -> None:
    """Plain floats become bfloat16; quantized weights, scales, integers and the names the
    model keeps in float32 (`_keep_in_fp32_modules*`) keep their dtype and bits."""
    out = _merge(moe_root, name, tmp_path / "merged", dtype="bfloat16")
    merged = load_file(out / "model.safetensors")
    original = load_file(moe_root / name / "base" / "model.safetensors")
    kept = _kept_in_float32(name)
    casts = 0
    for key, t in original.items():
        quantized = t.dtype in (torch.float8_e4m3fn, torch.int64, torch.uint8)
        quantized = quantized or key.endswith(("_scale_inv", "_scales"))
        if quantized or (kept is not None and kept.search(key)):
            assert merged[key].dtype == t.dtype and torch.equal(_bits(merged[key]), _bits(t)), key
        else:
            casts += 1
            assert merged[key].dtype == torch.bfloat16, key
            assert torch.equal(merged[key], t.bfloat16()), key
    assert casts > 0


@pytest.mark.slow
def test_a_checkpoint_with_per_expert_names_merges_alike(moe_root: Path, tmp_path: Path) -> None:
    """A checkpoint saved under the saved names (transformers 4.x training) maps directly."""
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    shutil.copytree(moe_root / "qwen3_moe" / "base", run / "base")
    saved = load_file(run / "base" / "model.safetensors")
    assert any(".experts.3.up_proj.weight" in k for k in saved)
    dcp.save(saved, checkpoint_id=run / "model", no_dist=True)
    cfg = {"base_model": str(run / "base"), "output_dir": str(run)}
    out = merge_fsdp_weights(cfg, tmp_path / "merged", checkpoint=run / "model", verify=True)
    assert (out / "model.safetensors").read_bytes() == (
        run / "base" / "model.safetensors"
    ).read_bytes()
