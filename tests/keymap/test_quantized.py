"""Quantized weights' stored names (`keymap.quantized`): MXFP4-packed experts as gpt-oss stores
them, and which tensors keep their dtype in any cast (quantized weights and their scales)."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from shardforge.keymap.quantized import kept_as_stored, mxfp4_packed, quant_method, scale_names

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]


def _config(quantization: dict[str, object] | None) -> object:
    return AutoConfig.for_model("gpt_oss", hidden_size=64, quantization_config=quantization)


def test_mxfp4_experts_are_stored_packed() -> None:
    config = _config({"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED})
    assert quant_method(config) == "mxfp4"
    # [E, in, out] in memory -> blocks [E, out, in / 32, 16] and scales [E, out, in / 32]
    assert mxfp4_packed("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 128), config) == {
        "model.layers.0.mlp.experts.gate_up_proj_blocks": (4, 128, 2, 16),
        "model.layers.0.mlp.experts.gate_up_proj_scales": (4, 128, 2),
    }
    for name, shape in [
        ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 128)),  # not packed
        ("model.layers.0.mlp.router.weight", (4, 64)),
        ("model.layers.0.mlp.experts.down_proj", (4, 48, 64)),  # 48 is not whole blocks
    ]:
        assert mxfp4_packed(name, shape, config) == {}
    skipped = _config({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.1"]})
    assert mxfp4_packed("model.layers.1.mlp.experts.down_proj", (4, 64, 64), skipped) == {}
    assert quant_method(_config(None)) is None


def test_quantized_weights_and_their_scales_keep_their_dtype() -> None:
    dtypes = {
        "a.weight": torch.float8_e4m3fn,
        "a.weight_scale_inv": torch.float32,
        "b.weight": torch.bfloat16,
        "b.weight_scale_inv": torch.float32,  # beside a plain weight: cast as any float
        "experts.gate_up_proj": torch.float8_e5m2,
        "experts.gate_up_proj_scale_inv": torch.float32,
        "experts.down_proj_blocks": torch.uint8,
        "experts.down_proj_scales": torch.uint8,
        "experts.down_proj_bias": torch.float32,
        "router.tid2eid": torch.int64,
    }
    assert kept_as_stored(dtypes) == {
        "a.weight",
        "a.weight_scale_inv",
        "experts.gate_up_proj",
        "experts.gate_up_proj_scale_inv",
        "experts.down_proj_blocks",
        "experts.down_proj_scales",
    }
    assert scale_names("x.weight") == ("x.weight_scale_inv", "x.weight_scale")
    assert scale_names("x.down_proj_blocks") == ("x.down_proj_scales",)
