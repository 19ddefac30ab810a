"""The expected model from its config on the meta device; all mismatches in one error."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import make_config
from shardforge.errors import MergeError
from shardforge.formats.dcp.metadata import TensorEntry
from shardforge.merge.check import build_expected, check_against, clean_architectures


def test_tied_weights_are_stored_once() -> None:
    tied = build_expected(make_config("qwen2"), False)
    assert tied.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in tied.saved_names
    untied = build_expected(make_config("llama"), False)
    assert untied.tied == {} and "lm_head.weight" in untied.saved_names
    assert not untied.renamed_on_save


def test_weight_conversion_is_detected() -> None:
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
    assert build_expected(moe, False).renamed_on_save


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
