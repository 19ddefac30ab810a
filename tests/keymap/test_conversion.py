"""The saved layout (`keymap.conversion`) against transformers' own ``revert_weight_conversion``
on real tiny models: fused MoE experts cut per expert (qwen3_moe, mixtral: slices), renamed
modules around them (deepseek_v4), a many-to-one group (hrm_text: gate and up concatenated) and
an interleave (inkling2_text), both run by transformers' reversed converter. The same names in
the same order, and every saved tensor, rebuilt from its slice or its group, bit for bit what
transformers saves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.moe import CONFIGS
from shardforge.keymap.conversion import Slice, contiguous_span, saved_layout

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "tie_word_embeddings": False,
}
DEEPSEEK = CONFIGS["fp8"][1]
# model type -> (its tiny config, whether every group is cut into slices)
MODELS: dict[str, tuple[dict[str, Any], bool]] = {
    "qwen3_moe": ({"num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16}, True),
    "mixtral": ({"num_local_experts": 4}, True),
    # FP8-free: transformers' FP8 layout of it is tested through the merges
    "deepseek_v4": ({**DEEPSEEK, "quantization_config": None}, True),
    "hrm_text": ({}, False),
    "inkling2_text": ({"eos_token_id": 2}, False),
}


def _model(model_type: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **MODELS[model_type][0]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _cut(t: torch.Tensor, s: Slice) -> torch.Tensor:
    for dim, (first, n) in enumerate(zip(s.offsets, s.sizes, strict=True)):
        t = t.narrow(dim, first, n)
    return t.reshape(s.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_layout_is_what_transformers_saves(model_type: str) -> None:
    from transformers.core_model_loading import revert_weight_conversion

    model = _model(model_type)
    state = model.state_dict()
    saved = revert_weight_conversion(model, dict(state))
    layout = saved_layout(model, state)
    assert layout is not None
    assert list(layout.shapes) == list(saved)
    assert all(layout.shapes[k] == tuple(t.shape) for k, t in saved.items())
    rebuilt = {saved_name: state[memory] for saved_name, memory in layout.renamed.items()}
    for group in layout.groups:
        assert (group.slices is not None) == MODELS[model_type][1]
        converted = group.convert({s: state[s] for s in group.sources})
        assert list(converted) == list(group.outputs)
        for name, t in converted.items():
            assert torch.equal(_bits(t), _bits(saved[name])), name
        if group.slices is not None:
            rebuilt.update({n: _cut(state[s.source], s) for n, s in group.slices.items()})
        else:
            rebuilt.update(converted)
    assert rebuilt.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(_bits(rebuilt[name]), _bits(t)), name


def test_experts_are_contiguous_slices() -> None:
    layout = saved_layout(_model("qwen3_moe"), _model("qwen3_moe").state_dict())
    assert layout is not None
    group = next(g for g in layout.groups if g.sources[0].endswith("gate_up_proj"))
    assert group.slices is not None
    up = group.slices["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert (up.offsets, up.sizes, up.shape) == ((2, 32, 0), (1, 32, 64), (32, 64))
    assert contiguous_span((4, 64, 64), up.offsets, up.sizes) == (2 * 64 * 64 + 32 * 64, 32 * 64)


def test_a_model_saved_as_it_is_has_no_layout() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **COMMON))
    assert saved_layout(model, model.state_dict()) is None


def test_contiguous_span() -> None:
    full = (4, 6, 5)
    assert contiguous_span(full, (1, 2, 0), (1, 3, 5)) == (30 + 10, 15)
    assert contiguous_span(full, (1, 0, 0), (2, 6, 5)) == (30, 60)
    assert contiguous_span(full, (0, 2, 0), (2, 3, 5)) is None  # rows 2-4 of two experts
    assert contiguous_span(full, (0, 0, 1), (1, 1, 3)) == (1, 3)
    assert contiguous_span(full, (0, 0, 1), (1, 2, 3)) is None
    assert contiguous_span(full, (3, 5, 4), (1, 1, 1)) == (119, 1)
    assert contiguous_span(full, (1, 0, 0), (0, 6, 5)) == (30, 0)


def test_saved_state_dict_is_what_save_pretrained_writes(tmp_path: Any) -> None:
    """The real tensors of a model under the names save_pretrained writes (a FULL_STATE_DICT
    run's final save: experts per expert, as the base model's files)."""
    from safetensors.torch import load_file

    from shardforge.keymap.conversion import saved_state_dict

    model = _model("mixtral")
    model.save_pretrained(tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    saved = saved_state_dict(model, state)
    assert saved.keys() == written.keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved  # as Mixtral saves it
    for name, t in saved.items():
        assert t.is_contiguous() and torch.equal(t, written[name]), name
