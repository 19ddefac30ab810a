"""torch's varlen_attn through the adapter (`varlen.VarlenApi`), on CPU: a stand-in with the
exact signature of each version the declared torch range has (2.6-2.9: none; 2.10; 2.11;
2.12-2.14), computing what that version's kernel computes by per-sample sdpa, and refusing
what the kernel refuses (k/v heads fewer than q's without enable_gqa, a value head size other
than q's). A keyword a version lacks is a TypeError, as it would be on the GPU."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny import make_config
from shardforge.train import varlen
from shardforge.train.varlen import VarlenApi

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    window: tuple[int, int],
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """What torch's flash varlen kernel computes: window (left, right), -1 unbounded; its
    output has q's shape (every version allocates `empty_like(query)`)."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash: one head size for q, k and v"
    if not gqa:
        assert q.shape[1] == k.shape[1] == v.shape[1], "heads differ without enable_gqa"
    out = []
    for start, stop in itertools.pairwise(cu.tolist()):
        i = torch.arange(stop - start)
        rel = i[:, None] - i[None, :]  # query minus key position
        mask = torch.ones(len(i), len(i), dtype=torch.bool)
        if window[0] >= 0:
            mask &= rel <= window[0]
        if window[1] >= 0:
            mask &= rel >= -window[1]
        qs, ks, vs = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def varlen_2_10(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    return_aux: Any = None,
) -> torch.Tensor:
    window = (-1, 0) if is_causal else (-1, -1)
    return _kernel(query, key, value, cu_seq_q, window, None, False)


def varlen_2_11(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    return _kernel(query, key, value, cu_seq_q, window_size, scale, False)


def varlen_2_12(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = _kernel(query, key, value, cu_seq_q, window_size, scale, enable_gqa)
    return (out, torch.zeros(())) if return_aux is not None else out


VERSIONS: dict[str, Callable[..., Any]] = {
    "2.10": varlen_2_10,
    "2.11": varlen_2_11,
    "2.12-2.14": varlen_2_12,
}
CU = torch.tensor([0, 5, 14, 17, 20, 27, 33, 40], dtype=torch.int32)


def _qkv(dv: int) -> tuple[torch.Tensor, ...]:
    """40 tokens, 4 query heads of size 10, 2 key/value heads (values of size `dv`)."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((40, 4, 10), (40, 2, 10), (40, 2, dv))
    return tuple(torch.randn(s, generator=gen, requires_grad=True) for s in shapes)


def test_this_torchs_signature_is_one_of_the_stand_ins() -> None:
    """The stand-ins are the real signatures: the installed torch's is one of them."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    real = [p.name for p in inspect.signature(varlen_attn).parameters.values()]
    assert real in [list(inspect.signature(f).parameters) for f in VERSIONS.values()]
    assert varlen.VARLEN_API is not None and varlen.VARLEN_API.usable()


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize(
    ("dv", "scale", "window"), [(10, 0.3, None), (6, None, None), (10, None, 3)]
)
def test_each_versions_kernel_gives_the_per_sample_attention(
    version: str, dv: int, scale: float | None, window: int | None
) -> None:
    """GQA, a value head size of its own (MLA), a scale other than the default, a sliding
    window: output and gradients equal sdpa sample by sample (the CPU twin)."""
    api = VarlenApi.of(VERSIONS[version])
    if window and version == "2.10":
        with pytest.raises(ValueError, match="no sliding window"):
            api(*_qkv(dv), CU, 20, scale, window)
        return
    q, k, v = _qkv(dv)
    got = api(q, k, v, CU, 20, scale, window)
    got.square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    q, k, v = _qkv(dv)
    want = varlen._per_sample(q, k, v, CU, scale, window)
    want.square().sum().backward()
    assert got.shape == want.shape == (40, 4, dv)
    torch.testing.assert_close(got, want, **TOL)
    for mine, theirs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, theirs, **TOL)


def test_a_keyword_the_version_lacks_fails() -> None:
    """What the old call passed (`scale=`, `is_causal=` keyword-only) each version refuses."""
    q, k, v = (t.detach() for t in _qkv(10))
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    with pytest.raises(TypeError, match="scale"):
        varlen_2_10(q, k, v, CU, CU, 20, 20, scale=0.3)
    with pytest.raises(TypeError, match="is_causal"):
        varlen_2_11(q, k, v, CU, CU, 20, 20, scale=0.3, is_causal=True)
    with pytest.raises(TypeError, match="enable_gqa"):
        varlen_2_11(q, k, v, CU, CU, 20, 20, enable_gqa=True)


# -- a whole model through the kernel's path, packed, on CPU -------------------------------------


LENGTHS = [[5, 9, 3], [7, 6]]
T = 20


def _config(model_type: str) -> Any:
    """llama: 4 query heads, 2 key/value heads. deepseek_v2 (MLA): query/key head size 12
    (8 + 4 rotary), value head size 6."""
    if model_type == "llama":
        return make_config("llama")
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "deepseek_v2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        pad_token_id=3,
    )


def _packed() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    from shardforge.train.packing import position_ids

    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(4, 300, (n,), generator=gen) for row in LENGTHS for n in row]
    rows, i = [], 0
    for row in LENGTHS:
        ids = torch.cat(samples[i : i + len(row)])
        rows.append(F.pad(ids, (0, T - len(ids)), value=3))
        i += len(row)
    positions = torch.tensor([position_ids(row, T) for row in LENGTHS])
    return torch.stack(rows), positions, samples


def _split(packed: torch.Tensor) -> list[torch.Tensor]:
    return [
        packed[b, sum(row[:j]) : sum(row[: j + 1])]
        for b, row in enumerate(LENGTHS)
        for j in range(len(row))
    ]


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2"])
def test_a_packed_model_through_each_versions_kernel_equals_its_samples_alone(
    monkeypatch: pytest.MonkeyPatch, model_type: str
) -> None:
    """What a GPU run does after sdpa is switched to varlen_attention (the decoder hooked, the
    kernel called through the adapter), with each version's stand-in as the kernel: the
    logits and gradients of a packed batch are those of its samples alone under sdpa. The
    MLA model's values have a head size of their own (the old code reshaped them with q's)."""
    from transformers import AutoModelForCausalLM

    from shardforge.train.attention import VARLEN, PackedInputs

    ids, positions, samples = _packed()
    torch.manual_seed(0)
    alone_model = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="sdpa")
    want_logits, want_loss = [], torch.zeros(())
    for sample in samples:
        logits = alone_model(input_ids=sample[None]).logits[0]
        want_logits.append(logits.detach())
        want_loss = want_loss + F.cross_entropy(logits[:-1], sample[1:], reduction="sum")
    want_loss.backward()
    want_grads = {n: p.grad for n, p in alone_model.named_parameters() if p.grad is not None}
    for version, fn in VERSIONS.items():
        monkeypatch.setattr(varlen, "kernel_for", lambda device, fn=fn: VarlenApi.of(fn))
        model = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation=VARLEN)
        model.load_state_dict(alone_model.state_dict())
        model.get_decoder().register_forward_pre_hook(PackedInputs("varlen"), with_kwargs=True)
        packed = model(input_ids=ids, position_ids=positions).logits
        loss = sum(
            F.cross_entropy(p[:-1], s[1:], reduction="sum")
            for p, s in zip(_split(packed), samples, strict=True)
        )
        loss.backward()
        for got, want in zip(_split(packed), want_logits, strict=True):
            torch.testing.assert_close(got, want, **TOL, msg=version)
        for name, param in model.named_parameters():
            if name in want_grads:
                torch.testing.assert_close(param.grad, want_grads[name], **TOL, msg=name)
