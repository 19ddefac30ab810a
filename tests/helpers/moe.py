"""DCP checkpoints of mixture-of-experts and quantized models, written once by 2 real gloo ranks
(one launch) with ``fully_shard`` and ``torch.distributed.checkpoint.save``:

    root = moe_checkpoints(tmp_path_factory)      # shared by every test that asks

Each ``<name>/`` holds ``base/`` (the model as ``save_pretrained`` writes it: config, weights,
tokenizer) and ``model/`` (the DCP checkpoint of the in-memory state dict, fused names):

* ``qwen3_moe``: fused experts (``mlp.experts.gate_up_proj`` [E, 2I, H]) that transformers
  saves per expert;
* ``fp8``: a DeepSeek-V4-style model with FP8 weights (``float8_e4m3fn`` + ``weight_scale_inv``
  from transformers' FP8 quantizer), fused float experts saved per expert under renamed
  modules, and an int64 buffer (the hash router's ``tid2eid``);
* ``mxfp4``: gpt-oss with MXFP4-packed experts (uint8 ``*_blocks`` and ``*_scales``), written
  with the ``safetensors`` library (transformers cannot pack MXFP4 without its kernels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from helpers.shared import shared_folder
from helpers.tiny import make_tokenizer

WORLD = 2
VOCAB = 320
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "qwen3_moe",
        {
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "fp8": (
        "deepseek_v4",
        {
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "q_lora_rank": 32,
            "num_experts_per_tok": 2,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "o_groups": 2,
            "o_lora_rank": 32,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
            "num_nextn_predict_layers": 0,
            "hc_mult": 2,
            "sliding_window": 8,
            "mlp_layer_types": ["hash_moe", "moe"],
            "quantization_config": {
                "quant_method": "fp8",
                "weight_block_size": [32, 32],
                "activation_scheme": "dynamic",
                "modules_to_not_convert": ["mlp.experts", "lm_head"],
            },
        },
    ),
    "mxfp4": (
        "gpt_oss",
        {
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            },
        },
    ),
}
IDS = torch.tensor([[1, 5, 9, 33, 120, 7, 250, 2], [1, 44, 45, 46, 47, 48, 49, 50]])


def config(name: str) -> Any:
    from transformers import AutoConfig

    model_type, extra = CONFIGS[name]
    return AutoConfig.for_model(model_type, **COMMON, **extra)


def _fp8_model(cfg: Any) -> Any:
    """The FP8 model as transformers' quantizer lays it out, with seeded FP8 weights, scales
    and hash-routing table (the float weights as initialised)."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    floats = {k: v.clone() for k, v in model.state_dict().items()}
    quantizer = AutoHfQuantizer.from_config(cfg.quantization_config, pre_quantized=True)
    quantizer.quantization_config.dequantize = False
    quantizer.preprocess_model(model, config=cfg)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if key in floats and floats[key].dtype == t.dtype and floats[key].shape == t.shape:
                t.copy_(floats[key])
            elif t.dtype == torch.float8_e4m3fn:
                t.copy_((torch.randn(t.shape, generator=g) * 0.5).to(t.dtype))
            elif key.endswith("scale_inv"):
                t.copy_(torch.rand(t.shape, generator=g) * 0.1 + 0.01)
            elif t.dtype == torch.int64:
                t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g))
    return model


def _mxfp4_state(cfg: Any) -> dict[str, torch.Tensor]:
    """gpt-oss's state dict with its experts MXFP4-packed: random 4-bit codes, exponents near 0."""
    from transformers import AutoModelForCausalLM

    from shardforge.keymap.quantized import mxfp4_packed

    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(5)
    out = {}
    for key, t in model.state_dict().items():
        packed = mxfp4_packed(key, tuple(t.shape), cfg)
        for name, shape in packed.items():
            low, high = (0, 256) if name.endswith("_blocks") else (124, 128)
            out[name] = torch.randint(low, high, shape, generator=g, dtype=torch.uint8)
        if not packed:
            out[key] = t.detach().clone()
    return out


def _write_base(name: str, root: Path) -> None:
    """`<name>/base/`: the model as published (what the merge must give back)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = root / name / "base"
    cfg = config(name)
    torch.manual_seed(0)
    if name == "mxfp4":
        base.mkdir(parents=True)
        cfg.save_pretrained(base)
        save_file(_mxfp4_state(cfg), str(base / "model.safetensors"), metadata={"format": "pt"})
    else:
        model = _fp8_model(cfg) if name == "fp8" else AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(base)
    make_tokenizer(VOCAB).save_pretrained(base)


def _in_memory(name: str, root: Path) -> Any:
    """The model as training holds it (in-memory names), loaded from `base/`."""
    from safetensors.torch import load_file
    from torch import nn
    from transformers import AutoModelForCausalLM

    base = root / name / "base"
    if name == "mxfp4":  # a plain module holding the packed state dict as it is stored
        holder = nn.Module()
        for key, t in load_file(base / "model.safetensors").items():
            holder.register_buffer(key.replace(".", "__"), t)
        return holder
    if name == "fp8":
        return _fp8_model(config(name))
    return AutoModelForCausalLM.from_pretrained(base)


def _save(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    out = Path(root)
    if rank == 0:
        for name in CONFIGS:
            _write_base(name, out)
    dist.barrier()
    for name in CONFIGS:
        model = _in_memory(name, out)
        if name == "mxfp4":
            state = {k.replace("__", "."): v for k, v in model.state_dict().items()}
        else:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            state = model.state_dict()
        dcp.save(state, checkpoint_id=out / name / "model")


def build(root: Path) -> None:
    root.mkdir(parents=True)
    run_on_ranks(_save, WORLD, str(root))
    (root / "configs.json").write_text(json.dumps(sorted(CONFIGS)))


def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints above, built once per test run (see the module docstring)."""
    return shared_folder(tmp_path_factory, "moe-checkpoints", build)


def logits(model_dir: Path) -> torch.Tensor:
    """The logits transformers gives for `IDS` (quantized weights dequantized on the CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits
