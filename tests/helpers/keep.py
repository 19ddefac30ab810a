"""A tiny causal LM class that keeps a module in float32 and has an int buffer, and a DCP
checkpoint of it with one FP8 weight (written by torch's own `dcp.save`).

    base, ckpt = make_keep_checkpoint(tmp_path)    # the model class is registered with Auto*

The class is a real transformers model (a `LlamaForCausalLM` with a `router` linear and an
int64 `router_calls` buffer); it declares `_keep_in_fp32_modules = ["router"]`, as the models
that keep router weights and correction biases in float32 do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers.tiny import TINY_CONFIGS

MODEL_TYPE = "tiny_keep"
FP8_WEIGHT = "model.layers.0.mlp.down_proj.weight"
# stored as a transposed view: its record is not one contiguous slab (copied through memory)
STRIDED = "model.layers.0.self_attn.o_proj.weight"
KEPT = "router.weight"
INT_BUFFER = "router_calls"
# the classes, once registered in this process
_REGISTERED: list[tuple[type, type]] = []


def keep_classes() -> tuple[type, type]:
    """The config and model classes, registered with AutoConfig / AutoModelForCausalLM once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if _REGISTERED:
        return _REGISTERED[0]

    class TinyKeepConfig(LlamaConfig):
        model_type = MODEL_TYPE

    class TinyKeepForCausalLM(LlamaForCausalLM):
        config_class = TinyKeepConfig
        _keep_in_fp32_modules = ("router",)

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.router = torch.nn.Linear(config.hidden_size, 4, bias=False)
            self.register_buffer(INT_BUFFER, torch.arange(4, dtype=torch.int64))

    AutoConfig.register(MODEL_TYPE, TinyKeepConfig)
    AutoModelForCausalLM.register(TinyKeepConfig, TinyKeepForCausalLM)
    _REGISTERED.append((TinyKeepConfig, TinyKeepForCausalLM))
    return _REGISTERED[0]


def make_keep_checkpoint(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A base directory (config.json of the registered class) and a DCP checkpoint of the model
    with `FP8_WEIGHT` stored as float8_e4m3fn (the rest float32, `INT_BUFFER` int64), and
    `STRIDED` stored transposed in memory (same values)."""
    import torch
    import torch.distributed.checkpoint as dcp

    config_cls, model_cls = keep_classes()
    config = config_cls(vocab_size=320, bos_token_id=1, eos_token_id=2, **TINY_CONFIGS["llama"])
    torch.manual_seed(seed)
    model = model_cls(config)
    base = root / "base"
    config.save_pretrained(base)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[FP8_WEIGHT] = state[FP8_WEIGHT].to(torch.float8_e4m3fn)
    state[STRIDED] = state[STRIDED].t().contiguous().t()
    ckpt = root / "checkpoint"
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    torch.save(state, root / "state.pt")  # what was saved, to compare the merge with
    return base, ckpt
