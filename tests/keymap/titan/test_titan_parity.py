"""Parity with torchtitan itself: a tiny torchtitan Llama 3, converted by our adapter, loaded into
HF LlamaForCausalLM, gives torchtitan's logits; and our tensors equal torchtitan's own `to_hf`.

torchtitan (0.3.0, checked on CPU with torch 2.13) is part of the test setup: cicd/setup.sh
installs it and `spmd_types` with `--no-deps` (torchtitan asks for datasets<4.8, torchdata and
torch_checkpointing, none of which this import path uses), its other imports (`tyro`,
`einops`) come with the dev extra, and cicd/constraints.txt pins all of them. Its model
package also imports the expert-parallel MoE kernels (`torchtitan.distributed.minimal_async_ep`,
Triton GPU code, a large package) that a dense Llama never calls: without triton they are
replaced by a stand-in that raises if called (`_without_triton`).

The logits are compared with a tolerance: torchtitan runs FlexAttention (compiled by
torch.compile for the CPU), HF its SDPA/eager kernel, so the two differ by float rounding
even with identical weights.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch

from shardforge.keymap.titan import get_adapter

EP_KERNELS = "torchtitan.distributed.minimal_async_ep"


def _without_triton() -> None:
    """Where triton is not installed, stand in for torchtitan's Triton MoE kernels (imported by
    every torchtitan model, used only by expert-parallel MoE training)."""
    if importlib.util.find_spec("triton") is not None or EP_KERNELS in sys.modules:
        return

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{EP_KERNELS} needs triton (a stand-in in this test)")

    stub = types.ModuleType(EP_KERNELS)
    for name in (
        "combine_op",
        "dispatch_op",
        "init_buffer",
        "maybe_update_minimal_async_ep_config",
    ):
        setattr(stub, name, unavailable)
    stub.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})  # type: ignore[attr-defined]
    sys.modules[EP_KERNELS] = stub


_without_triton()

DIM, HEADS, KV_HEADS, LAYERS, FFN, VOCAB, THETA = 64, 4, 2, 2, 128, 331, 10000.0


def _titan_model() -> Any:
    import torchtitan.models.llama3 as titan
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    config = titan.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=titan._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=titan._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=titan._output_linear_init(DIM)
        ),
        layers=titan._build_llama3_layers(
            fuse_qkv=True,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=256, theta=THETA, scaling="none"),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    # sharpen attention (the default init makes it nearly uniform, so a wrong q/k order would
    # hardly change the logits); loading goes through torchtitan's own fused-QKV hook
    state = model.state_dict()
    for key in state:
        if key.endswith(("wq.weight", "wk.weight")):
            state[key] = state[key] * 40
    model.load_state_dict(state)
    return config, model.eval()


def _hf_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        rope_theta=THETA,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


@pytest.mark.slow
def test_torchtitan_llama3_logits_and_to_hf_parity() -> None:
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    from transformers import LlamaForCausalLM

    titan_config, titan_model = _titan_model()
    titan_sd = {k: v.detach().clone() for k, v in titan_model.state_dict().items()}
    assert "layers.0.attention.qkv_linear.wq.weight" in titan_sd

    config = _hf_config()
    adapter = get_adapter("llama")
    ours = {}
    for name, tensor in titan_sd.items():
        hf_name = adapter.convert_name(name)
        if hf_name is not None:
            ours[hf_name] = adapter.transform(hf_name, tensor, config)
    theirs = Llama3StateDictAdapter(titan_config, None).to_hf(dict(titan_sd))
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name

    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        expected = titan_model(tokens, positions, titan_model.get_attention_masks(positions))

    def hf_logits(state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
        hf = LlamaForCausalLM(config).eval()
        hf.load_state_dict(state_dict, strict=True)
        with torch.no_grad():
            return hf(input_ids=tokens).logits

    torch.testing.assert_close(hf_logits(ours), expected, rtol=1e-5, atol=5e-6)
    # without the RoPE permutation the logits are clearly wrong: the check is sensitive to it
    unpermuted = {
        get_adapter("llama").to_hf_name(k): v for k, v in titan_sd.items() if "rope" not in k
    }
    assert not torch.allclose(hf_logits(unpermuted), expected, rtol=1e-2, atol=1e-2)
