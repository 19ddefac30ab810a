"""torchtitan -> HF adapters: names, skipped entries, tied output, and a round trip through a
real HF model (state dict converted to torchtitan form by an independent reference here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny import make_model
from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.keymap.titan import ADAPTERS, get_adapter, is_model_key

# Reference inverse tables written independently of the product's (HF -> torchtitan).
_HF_TO_TITAN_OLD = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TO_TITAN_NEW = {
    **_HF_TO_TITAN_OLD,
    "lm_head.weight": "lm_head.weight",
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
}


def _titan_name(hf_name: str, table: dict[str, str]) -> str:
    if hf_name in table:
        return table[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.<i>.<rest>
    return f"layers.{layer}.{table[rest]}"


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reference inverse permutation by explicit indices: titan row 2i+j <- HF row j*hd/2+i."""
    head_dim = w.shape[0] // n_heads
    index = [
        h * head_dim + j * (head_dim // 2) + i
        for h in range(n_heads)
        for i in range(head_dim // 2)
        for j in range(2)
    ]
    return w[torch.tensor(index)]


def _to_titan(
    hf_sd: dict[str, torch.Tensor], config: dict, table: dict[str, str], permute: bool
) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf_sd.items():
        if permute and name.endswith("q_proj.weight"):
            t = _to_interleaved(t, config["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            t = _to_interleaved(t, config["num_key_value_heads"])
        out[_titan_name(name, table)] = t.clone()
    return out


def to_hf(adapter: Any, titan_sd: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Convert a torchtitan state dict the way the merge does, name by name."""
    out = {}
    for name, tensor in titan_sd.items():
        hf_name = adapter.convert_name(name)
        if hf_name is not None:
            out[hf_name] = adapter.transform(hf_name, tensor, config)
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 33, 120, 7, 250, 2], [1, 44, 45, 46, 47, 48, 49, 50]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_registry_and_unknown_type() -> None:
    assert get_adapter("llama") is ADAPTERS["llama"]
    with pytest.raises(ShardforgeError, match=r"'gpt2'.*supported: llama, qwen3"):
        get_adapter("gpt2")


@pytest.mark.parametrize(
    ("titan", "hf"),
    [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.0.attention.wq.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("layers.17.attention.qkv_linear.wk.weight", "model.layers.17.self_attn.k_proj.weight"),
        ("layers.3.feed_forward.w2.weight", "model.layers.3.mlp.down_proj.weight"),
        ("layers.10.ffn_norm.weight", "model.layers.10.post_attention_layernorm.weight"),
        ("output.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.layers.2.attention.wo.weight", "model.layers.2.self_attn.o_proj.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ],
)
def test_llama_names(titan: str, hf: str) -> None:
    assert get_adapter("llama").to_hf_name(titan) == hf


def test_unknown_keys_are_listed() -> None:
    llama = get_adapter("llama")
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attention\.q_norm\.weight'.*'llama'"):
        llama.to_hf_name("layers.0.attention.q_norm.weight")
    with pytest.raises(CheckpointError, match=r"2 torchtitan key\(s\).*foo.bar, layers.1.moe.x"):
        llama.check_names(["norm.weight", "freqs_cis", "foo.bar", "layers.1.moe.x"])
    llama.check_names(["norm.weight", "model.freqs_cis", "layers.0.attention.rope.cache"])
    # a layer index where the table has none is not silently accepted
    with pytest.raises(CheckpointError):
        llama.to_hf_name("norm.3.weight")


def test_training_state_is_not_model() -> None:
    for name in (
        "optimizer.state.layers.0.attention.wq.weight.exp_avg",
        "lr_scheduler.0",
        "train_state",
        "dataloader.dp_rank_0",
    ):
        assert not is_model_key(name), name
    for name in ("layers.0.attention.wq.weight", "model.tok_embeddings.weight", "norm.weight"):
        assert is_model_key(name), name


def test_skipped_and_tied_entries() -> None:
    llama = get_adapter("llama")
    assert llama.convert_name("freqs_cis") is None
    assert llama.convert_name("model.freqs_cis") is None
    assert llama.convert_name("output.weight") == "lm_head.weight"  # tied or not: compared later
    assert llama.needs_transform("model.layers.4.self_attn.q_proj.weight")
    assert llama.needs_transform("model.layers.4.self_attn.k_proj.weight")
    assert not llama.needs_transform("model.layers.4.self_attn.v_proj.weight")
    assert not get_adapter("qwen3").needs_transform("model.layers.4.self_attn.q_proj.weight")
    v = torch.randn(4, 4)
    assert llama.transform("model.layers.0.self_attn.v_proj.weight", v, {}) is v
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        llama.transform("model.layers.0.self_attn.q_proj.weight", v, {})


@pytest.mark.parametrize(
    ("table", "legacy_prefix"),
    [(_HF_TO_TITAN_OLD, True), (_HF_TO_TITAN_OLD, False), (_HF_TO_TITAN_NEW, False)],
    ids=["old-model-prefixed", "old", "0.3.0"],
)
def test_llama_round_trip_bit_exact_and_equal_logits(
    tmp_path: Path, table: dict[str, str], legacy_prefix: bool
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    # head_dim 16 with 4 query and 2 key/value heads: GQA, and a permutation that is not its
    # own inverse
    model_dir = make_model(tmp_path / "base", "llama", vocab_size=331, with_tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    original = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hf_sd = original.state_dict()
    titan_sd = _to_titan(hf_sd, config, table, permute=True)
    if legacy_prefix:
        titan_sd = {f"model.{k}": v for k, v in titan_sd.items()}
    titan_sd["freqs_cis"] = torch.randn(8, 8)  # a buffer torchtitan may save; not a weight
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(titan_sd[next(k for k in titan_sd if "wq" in k)], hf_sd[q0])

    adapter = get_adapter(config["model_type"])
    adapter.check_names(titan_sd)
    converted = to_hf(adapter, titan_sd, config)
    assert set(converted) == set(hf_sd)
    for name, t in hf_sd.items():
        assert torch.equal(converted[name], t), name

    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    fresh.load_state_dict(converted, strict=True)
    assert torch.equal(_logits(fresh), _logits(original))


def test_qwen3_tied_round_trip(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=331,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config).eval()
    hf_sd = original.state_dict()
    assert "model.layers.0.self_attn.q_norm.weight" in hf_sd
    titan_sd = _to_titan(hf_sd, config.to_dict(), _HF_TO_TITAN_NEW, permute=False)
    assert "lm_head.weight" in titan_sd  # torchtitan keeps the tied output under its own key

    adapter = get_adapter(config.model_type)
    converted = to_hf(adapter, titan_sd, config)
    # kept under its HF name: the merge compares the tied copies and stores one
    assert torch.equal(converted["lm_head.weight"], converted["model.embed_tokens.weight"])
    for name, t in converted.items():
        assert torch.equal(t, hf_sd[name]), name

    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = fresh.load_state_dict(converted, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    fresh.tie_weights()
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(fresh), _logits(original))
