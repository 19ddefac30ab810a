"""The RoPE q/k row permutation: hand-checked order, inverse, and proof of direction."""

from __future__ import annotations

import pytest
import torch

from shardforge.errors import CheckpointError
from shardforge.keymap.titan.rope_permute import half_to_interleaved, interleaved_to_half


def test_head_dim_4_by_hand() -> None:
    # two heads of head_dim 4; row value = torchtitan row index, 3 input columns
    titan = torch.arange(8, dtype=torch.float32).repeat_interleave(3).view(8, 3)
    hf = interleaved_to_half(titan, n_heads=2)
    # per head: pairs (0,1), (2,3) -> halves [0, 2 | 1, 3]
    assert hf[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(hf[:, 1], hf[:, 0]) and torch.equal(hf[:, 2], hf[:, 0])


def test_head_dim_8_by_hand_and_inverse() -> None:
    titan = torch.arange(8, dtype=torch.float32).view(8, 1)
    hf = interleaved_to_half(titan, n_heads=1)
    assert hf[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    # the inverse direction is a different permutation for head_dim 8
    assert half_to_interleaved(titan, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(half_to_interleaved(hf, 1), titan)


def test_input_is_not_modified_and_bias_vectors_work() -> None:
    w = torch.randn(16, 5)
    before = w.clone()
    out = interleaved_to_half(w, 2)
    assert torch.equal(w, before) and out.is_contiguous()
    b = torch.arange(16.0)
    expected = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert interleaved_to_half(b, 2).tolist() == expected


@pytest.mark.parametrize(("rows", "heads"), [(12, 5), (6, 2), (8, 0)])
def test_bad_head_split_is_refused(rows: int, heads: int) -> None:
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        interleaved_to_half(torch.zeros(rows, 4), heads, what="q_proj")


def _rope_interleaved(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta/torchtitan RoPE: rotate adjacent pairs as complex numbers. x: (T, H, D)."""
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(pos.double(), freqs)  # (T, D/2)
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2))
    return torch.view_as_real(xc * rot).reshape(x.shape)


def test_direction_matches_hf_rotary_embedding() -> None:
    """Attention scores with torchtitan's interleaved RoPE on the original weights equal
    those with HF's half-split RoPE on the converted weights (and not with the inverse)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, head_dim, hidden, seq = 2, 8, 16, 5
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim)
    theta = float(cfg.rope_parameters["rope_theta"])
    wq = torch.randn(heads * head_dim, hidden, dtype=torch.float64)
    wk = torch.randn(heads * head_dim, hidden, dtype=torch.float64)
    x = torch.randn(seq, hidden, dtype=torch.float64)
    pos = torch.arange(seq)

    def titan_scores() -> torch.Tensor:
        q = _rope_interleaved((x @ wq.T).view(seq, heads, head_dim), pos, theta)
        k = _rope_interleaved((x @ wk.T).view(seq, heads, head_dim), pos, theta)
        return torch.einsum("thd,shd->hts", q, k)

    def hf_scores(wq_hf: torch.Tensor, wk_hf: torch.Tensor) -> torch.Tensor:
        rotary = LlamaRotaryEmbedding(cfg)
        q = (x @ wq_hf.T).view(1, seq, heads, head_dim).transpose(1, 2)
        k = (x @ wk_hf.T).view(1, seq, heads, head_dim).transpose(1, 2)
        cos, sin = rotary(q.float(), pos[None])
        q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        return torch.einsum("htd,hsd->hts", q[0], k[0])

    expected = titan_scores()
    right = hf_scores(interleaved_to_half(wq, heads), interleaved_to_half(wk, heads))
    wrong = hf_scores(half_to_interleaved(wq, heads), half_to_interleaved(wk, heads))
    torch.testing.assert_close(right, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(wrong, expected, rtol=1e-3, atol=1e-3)
