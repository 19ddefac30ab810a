"""The expected model from its config on the meta device (quantized as transformers loads it,
named as it saves it); all mismatches in one error."""

from __future__ import annotations

import pytest
import torch

from helpers.moe import config as moe_config
from helpers.tiny import make_config
from shardforge.errors import MergeError
from shardforge.formats.dcp.metadata import TensorEntry
from shardforge.merge.check import (
    ExpectedModel,
    build_expected,
    check_against,
    clean_architectures,
)


def test_tied_weights_are_stored_once() -> None:
    tied = build_expected(make_config("qwen2"), False)
    assert tied.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in tied.saved_names
    untied = build_expected(make_config("llama"), False)
    assert untied.tied == {} and "lm_head.weight" in untied.saved_names
    assert not untied.renamed_on_save


def _mixtral() -> ExpectedModel:
    from transformers import AutoConfig

    moe = AutoConfig.for_model(
        "mixtral",
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        vocab_size=300,
    )
    return build_expected(moe, False)


def test_fused_experts_are_expected_under_the_names_they_are_saved_as() -> None:
    exp = _mixtral()
    assert exp.renamed_on_save and exp.saved is not None
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert exp.shapes[fused] == (2, 128, 64) and fused not in exp.saved_names
    w1 = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    assert exp.saved.shapes[w1] == (64, 64) and w1 in exp.saved_names
    # a checkpoint may hold either: the in-memory (fused) or the saved (per-expert) names
    assert {fused, w1} <= set(exp.accepted)


def _entries(exp: ExpectedModel, names: list[str]) -> dict[str, TensorEntry]:
    return {n: TensorEntry(n, (n,), exp.dtype_of(n), exp.accepted[n], ()) for n in names}


def test_missing_tensors_are_named_as_the_checkpoint_names_them() -> None:
    exp = _mixtral()
    assert exp.saved is not None
    in_memory = list(exp.shapes)
    check_against(exp, _entries(exp, in_memory), {n: n for n in in_memory}, [], "base")
    per_expert = list(exp.saved.shapes)
    check_against(exp, _entries(exp, per_expert), {n: n for n in per_expert}, [], "base")
    cases = [
        (in_memory, "model.layers.0.mlp.experts.down_proj"),
        (per_expert, "model.layers.0.block_sparse_moe.experts.1.w2.weight"),
    ]
    for names, dropped in cases:
        kept = [n for n in names if n != dropped]
        with pytest.raises(MergeError) as info:
            check_against(exp, _entries(exp, kept), {n: n for n in kept}, [], "base")
        assert info.value.details == [f"missing: {dropped}"]


def test_fp8_weights_and_scales_are_expected() -> None:
    config = make_config(
        "llama",
        quantization_config={
            "quant_method": "fp8",
            "weight_block_size": [32, 32],
            "activation_scheme": "dynamic",
            "modules_to_not_convert": ["lm_head"],
        },
    )
    exp = build_expected(config, False)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert exp.dtypes[q] == torch.float8_e4m3fn and exp.shapes[q] == (64, 64)
    assert exp.dtypes[f"{q}_scale_inv"] == torch.float32 and exp.shapes[f"{q}_scale_inv"] == (2, 2)
    assert exp.dtypes["lm_head.weight"] == torch.float32
    assert "lm_head.weight_scale_inv" not in exp.shapes


def test_mxfp4_experts_are_expected_packed() -> None:
    config = moe_config("mxfp4")  # gpt-oss, hidden 64, 4 experts of 64
    exp = build_expected(config, False)
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    assert exp.shapes[blocks] == (4, 128, 2, 16) and exp.dtypes[blocks] == torch.uint8
    assert exp.shapes["model.layers.0.mlp.experts.down_proj_scales"] == (4, 64, 2)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in exp.shapes
    assert not exp.renamed_on_save


def test_fsdp_prefix_is_removed() -> None:
    config = make_config("llama")
    config.architectures = ["FSDPLlamaForCausalLM"]
    clean_architectures(config)
    assert config.architectures == ["LlamaForCausalLM"]


def test_every_problem_counted_in_the_headline_and_listed_in_details() -> None:
    exp = build_expected(make_config("llama"), False)
    names = [n for n in exp.saved_names if n != "model.norm.weight"]
    entries = {n: TensorEntry(n, (n,), torch.float32, exp.shapes[n], ()) for n in names}
    first = names[0]
    entries[first] = TensorEntry(first, (first,), torch.float32, (1, 2), ())
    entries["model.extra"] = TensorEntry("model.extra", ("x",), torch.float32, (1,), ())
    to_hf = {n: n for n in names}
    with pytest.raises(MergeError) as info:
        check_against(exp, entries, to_hf, ["model.extra"], "base")
    err = info.value
    assert "\n" not in err.message
    assert "(1 missing, 1 unexpected, 1 shape mismatches)" in err.message
    assert "missing: model.norm.weight" in err.details
    assert "unexpected: model.extra" in err.details
    shape = f"shape mismatch (checkpoint vs config): {first} [1, 2] vs"
    assert any(d.startswith(shape) for d in err.details)
