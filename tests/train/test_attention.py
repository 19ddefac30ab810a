"""Packed attention without a dense mask: the masks and boundaries built from the position ids
equal what transformers derives, and a packed window computes what its samples compute alone
through flex_attention's BlockMask and varlen_attention (float32, CPU)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.tiny import make_config
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train import attention
from shardforge.train.attention import (
    VARLEN,
    Choice,
    PackedInputs,
    choose,
    cu_seqlens,
    document_causal,
    document_ids,
    plain_attention,
    use_packed_attention,
)
from shardforge.train.packing import position_ids

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
TOL = {"rtol": 1e-5, "atol": 1e-5}
# two windows of 20 tokens: samples of 5, 9, 3 tokens (+3 padding) and 7, 6 (+7 padding)
LENGTHS = [[5, 9, 3], [7, 6]]
T = 20


def _positions() -> torch.Tensor:
    return torch.tensor([position_ids(row, T) for row in LENGTHS])


def test_document_ids_and_boundaries_follow_the_restarting_positions() -> None:
    pos = _positions()
    doc = document_ids(pos)
    assert doc[0].tolist() == [0] * 5 + [1] * 9 + [2] * 3 + [3] * 3  # the padding: its own
    assert doc[1].tolist() == [0] * 7 + [1] * 6 + [2] * 7
    assert cu_seqlens(pos).tolist() == [0, 5, 14, 17, 20, 27, 33, 40]
    assert cu_seqlens(pos).dtype == torch.int32


def test_the_block_mask_equals_transformers_dense_packed_mask() -> None:
    """The document-causal mask_mod over the full grid is the block-diagonal causal mask
    transformers' sdpa path builds from the same position ids; the BlockMask built from it
    keeps exactly those blocks."""
    from torch.nn.attention.flex_attention import create_mask
    from transformers.masking_utils import create_causal_mask

    pos = _positions()
    config = make_config("llama")
    config._attn_implementation = "sdpa"
    dense = create_causal_mask(config, torch.zeros(2, T, 8), None, None, position_ids=pos)
    ours = create_mask(document_causal(document_ids(pos)), 2, 1, T, T, device="cpu")
    assert dense is not None and dense.shape == ours.shape == (2, 1, T, T)
    assert torch.equal(ours, dense)
    assert not ours[0, 0, 5, 4] and ours[0, 0, 5, 5] and ours[0, 0, 13, 5]  # sample 2 alone
    block = attention.document_block_mask(document_ids(pos))
    assert block.shape[-2:] == (T, T)
    assert torch.equal(block.mask_mod(0, 0, torch.tensor(13), torch.tensor(5)), torch.tensor(True))


def test_flash_boundaries_are_transformers_own_over_the_flattened_batch() -> None:
    """flash_attention_2 derives cu_seqlens from position ids only at batch size 1 (with more
    rows it would attend across a window's samples); ours are what it derives from the
    flattened batch, and the max length a constant bound (no recompile per batch)."""
    from transformers.modeling_flash_attention_utils import (
        _is_packed_sequence,
        prepare_fa_kwargs_from_position_ids,
    )

    pos = _positions()
    assert not _is_packed_sequence(pos, batch_size=2)  # transformers would not split them
    (cu_q, cu_k), (longest, _) = prepare_fa_kwargs_from_position_ids(pos.reshape(1, -1))
    got = PackedInputs("varlen").inputs(pos)
    assert torch.equal(got["cu_seq_lens_q"], cu_q) and torch.equal(got["cu_seq_lens_k"], cu_k)
    assert got["max_length_q"] == got["max_length_k"] == T >= int(longest)


def _models(*impls: str) -> Iterator[torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    first = AutoModelForCausalLM.from_config(make_config("llama"), attn_implementation="sdpa")
    for impl in impls:  # each its own config: the attention implementation is kept there
        model = AutoModelForCausalLM.from_config(make_config("llama"), attn_implementation=impl)
        model.load_state_dict(first.state_dict())
        assert model.config._attn_implementation == impl
        yield model.train()


def _packed_batch() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(4, 300, (n,), generator=gen) for row in LENGTHS for n in row]
    rows, k = [], 0
    for row in LENGTHS:
        ids = torch.cat(samples[k : k + len(row)])
        rows.append(F.pad(ids, (0, T - len(ids)), value=3))
        k += len(row)
    return torch.stack(rows), _positions(), samples


def _split(packed: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            out.append(packed[b, start : start + n])
            start += n
    return out


def _hooked(model: torch.nn.Module, path: Any) -> torch.nn.Module:
    model.get_decoder().register_forward_pre_hook(PackedInputs(path), with_kwargs=True)
    return model


@pytest.fixture()
def flex_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers compiles flex_attention itself (inductor: a C++ compiler, about a minute
    on this CPU); flex_attention's own reference implementation (no dynamo) computes the same
    attention from the same BlockMask."""
    import torch.nn.attention.flex_attention as torch_flex
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)

    def plain(q: Any, k: Any, v: Any, training: bool = False, **kwargs: Any) -> Any:
        return flex_attention(q, k, v, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", plain)


def test_packed_flex_attention_equals_the_samples_alone(
    flex_uncompiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward only: flex_attention has no backward on CPU in this torch. The BlockMask is
    ours: transformers never looks for packed sequences in the position ids."""
    import transformers.masking_utils as masking

    def refuse(position_ids: torch.Tensor) -> None:
        raise AssertionError("transformers built the packed mask itself")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", refuse)
    ids, pos, samples = _packed_batch()
    alone_model, flex = _models("sdpa", "flex_attention")
    with torch.no_grad():
        packed = _hooked(flex, "block_mask")(input_ids=ids, position_ids=pos).logits
        alone = [alone_model(input_ids=s[None]).logits[0] for s in samples]
        crosstalk = alone_model(input_ids=ids).logits  # one causal mask over each window
    for got, want in zip(_split(packed), alone, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert (_split(crosstalk)[1] - alone[1]).abs().max() > 1e-2  # leaking would show


def test_packed_varlen_attention_equals_the_samples_alone_with_gradients() -> None:
    """The logits, and every parameter's gradient of the summed loss, of a packed batch
    through varlen_attention equal those of its samples run one by one (GQA model: 4 query
    heads, 2 key/value heads)."""
    ids, pos, samples = _packed_batch()
    alone_model, varlen = _models("sdpa", VARLEN)
    packed = _hooked(varlen, "varlen")(input_ids=ids, position_ids=pos).logits
    loss = sum(
        F.cross_entropy(p[:-1], s[1:], reduction="sum")
        for p, s in zip(_split(packed), samples, strict=True)
    )
    loss.backward()
    want = torch.zeros(())
    for got, sample in zip(_split(packed), samples, strict=True):
        alone = alone_model(input_ids=sample[None]).logits[0]
        torch.testing.assert_close(got, alone, **TOL)
        want = want + F.cross_entropy(alone[:-1], sample[1:], reduction="sum")
    want.backward()
    grads = dict(alone_model.named_parameters())
    for name, param in varlen.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, **TOL, msg=name)


def test_unpacked_rows_through_varlen_are_causal_rows() -> None:
    """Without boundaries (a padded batch), each row is one causal sequence."""
    ids, _, _ = _packed_batch()
    sdpa, varlen = _models("sdpa", VARLEN)
    with torch.no_grad():
        torch.testing.assert_close(varlen(input_ids=ids).logits, sdpa(input_ids=ids).logits, **TOL)


@pytest.fixture()
def full_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """What choose() asks of a GPU answers as an H100 with triton would (nothing runs on it)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "triton" else find_spec(name, *a),
    )


def test_the_packed_path_of_each_attention(full_gpu: None) -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose("flex_attention", CPU, fp32) == Choice("flex_attention", "block_mask")
    assert choose("flash_attention_2", CUDA, bf16) == Choice("flash_attention_2", "varlen")
    assert choose(VARLEN, CPU, fp32) == Choice(VARLEN, "varlen")
    assert choose("eager", CUDA, bf16) == Choice("eager", "transformers")
    # a sliding-window or soft-capped model: only transformers' own masks are exact
    assert choose("flex_attention", CUDA, bf16, plain=False).path == "transformers"
    assert choose("sdpa", CUDA, bf16, plain=False) == Choice("sdpa", "transformers")
    # sdpa: the dense mask only where nothing else runs, with a notice
    cpu = choose("sdpa", CPU, fp32)
    assert cpu.impl == "sdpa" and cpu.path == "transformers" and "dense" in cpu.notice
    assert choose(None, CPU, fp32).path == "transformers"
    on_gpu = choose("sdpa", CUDA, bf16)
    assert on_gpu.impl == VARLEN and on_gpu.path == "varlen" and on_gpu.notice
    fp32_gpu = choose("sdpa", CUDA, fp32)  # varlen and flash-attn need bf16/fp16
    assert fp32_gpu.impl == "flex_attention" and fp32_gpu.path == "block_mask"
    assert "flex_attention" in fp32_gpu.notice
    assert choose("sdpa", CUDA, fp32, flash_installed=True).impl == "flex_attention"
    assert choose("sdpa", CUDA, bf16, flash_installed=True).impl in (VARLEN, "flash_attention_2")


def test_sliding_window_and_softcap_models_are_not_plain() -> None:
    assert plain_attention(make_config("llama"))
    windowed = make_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert not plain_attention(windowed)
    assert plain_attention(make_config("qwen2"))  # use_sliding_window: false
    assert not plain_attention(make_config("llama", attn_logit_softcapping=50.0))


def test_sdpa_with_packing_on_cpu_keeps_the_dense_mask_with_a_notice(
    base_cfg: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    from shardforge.train.model import build_meta_model

    cfg = validate_cfg({**base_cfg, "attn_implementation": "sdpa"})
    model = build_meta_model(cfg)
    with caplog.at_level(logging.INFO, logger="shardforge"):
        choice = use_packed_attention(model, cfg, CPU)
    assert choice is not None and choice.path == "transformers"
    assert model.config._attn_implementation == "sdpa"
    assert any(
        "notice: sample_packing with attn_implementation sdpa" in r.message for r in caplog.records
    )
    assert not model.get_decoder()._forward_pre_hooks
    unpacked = validate_cfg({**base_cfg, "sample_packing": False})
    assert use_packed_attention(build_meta_model(unpacked), unpacked, CPU) is None


def test_flex_and_varlen_runs_hook_the_decoder(base_cfg: dict[str, Any]) -> None:
    from shardforge.train.model import build_meta_model

    for impl, path in (("flex_attention", "block_mask"), (VARLEN, "varlen")):
        cfg = validate_cfg({**base_cfg, "attn_implementation": impl})
        model = build_meta_model(cfg)
        # as built on a GPU (this CPU replaces flex_attention, which it cannot train, by sdpa)
        model.config._attn_implementation = impl
        assert use_packed_attention(model, cfg, CPU) == Choice(impl, path)
        hooks = list(model.get_decoder()._forward_pre_hooks.values())
        assert [type(h) for h in hooks] == [PackedInputs] and hooks[0].path == path


def test_sdpa_with_packing_on_a_gpu_switches_to_varlen(
    base_cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The decision for a GPU in bf16 (the device is only a label here: nothing runs on it)."""
    from shardforge.train.model import build_meta_model

    monkeypatch.setattr(attention, "varlen_missing", lambda device: None)
    cfg = validate_cfg({**base_cfg, "attn_implementation": "sdpa", "bf16": True})
    model = build_meta_model(cfg)
    with caplog.at_level(logging.INFO, logger="shardforge"):
        choice = use_packed_attention(model, cfg, CUDA)
    assert choice is not None and choice.impl == VARLEN and choice.path == "varlen"
    assert model.config._attn_implementation == VARLEN
    assert any("packed batches run varlen_attention" in r.message for r in caplog.records)
    fp32 = validate_cfg({**base_cfg, "attn_implementation": VARLEN, "bf16": False})
    with pytest.raises(ConfigError, match="bf16"):
        use_packed_attention(build_meta_model(fp32), fp32, CUDA)


def test_the_trainers_sharded_model_gets_the_packed_inputs(
    base_cfg: dict[str, Any], flex_uncompiled: None
) -> None:
    """Through the trainer's own model (build_meta_model, use_packed_attention, FSDP2, the base
    weights) and `model_inputs`: flex_attention (forward) and varlen_attention give the
    logits of sdpa's dense mask."""
    import torch.distributed as dist

    from shardforge.train.data import load_tokenizer, model_inputs
    from shardforge.train.eval import build_datasets
    from shardforge.train.model import build_meta_model, materialize_and_load, shard_model
    from shardforge.train.runtime import device_mesh, init_distributed

    rt = init_distributed()
    try:
        logits = {}
        for impl in ("eager", "flex_attention", VARLEN):
            cfg = validate_cfg({**base_cfg, "sequence_len": 128, "attn_implementation": impl})
            if impl == "eager":
                seqs = build_datasets(cfg, load_tokenizer(cfg)).train
                batch = seqs.select(list(range(3)))
            model = build_meta_model(cfg)
            use_packed_attention(model, cfg, CPU)
            shard_model(model, cfg, device_mesh(rt, (1,)))
            materialize_and_load(model, cfg, CPU, rt.rank)
            with torch.no_grad():
                logits[impl] = model(**model_inputs(batch, CPU)).logits
    finally:
        dist.destroy_process_group()
    assert batch.position_ids is not None and int((batch.position_ids == 0).sum()) >= 6
    torch.testing.assert_close(logits["flex_attention"], logits["eager"], **TOL)
    torch.testing.assert_close(logits[VARLEN], logits["eager"], **TOL)


def test_choose_never_switches_to_a_kernel_this_torch_or_gpu_cannot_run(
    full_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """varlen_attn needs torch 2.10+ and its flash kernel (a build with it, sm80+); the
    BlockMask route needs triton. Where neither runs, sdpa keeps the dense mask, saying why."""
    import importlib.util

    bf16 = torch.bfloat16
    assert choose("sdpa", CUDA, bf16).impl == VARLEN
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # T4
    assert choose("sdpa", CUDA, bf16).impl == "flex_attention"
    assert "8.0" in (attention.varlen_missing(CUDA) or "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert choose("sdpa", CUDA, bf16).impl == "flex_attention"
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(attention, "VARLEN_API", None)  # torch 2.6-2.9
    assert "no torch.nn.attention.varlen" in (attention.varlen_missing(CUDA) or "")
    assert choose("sdpa", CUDA, bf16).impl == "flex_attention"
    assert choose("sdpa", CUDA, bf16, flash_installed=True).impl == "flash_attention_2"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" else find_spec(name, *a),
    )
    dense = choose("sdpa", CUDA, bf16)
    assert dense == Choice("sdpa", "transformers", dense.notice) and "triton" in dense.notice


def test_sample_packing_keep_sdpa_keeps_the_dense_mask_on_a_gpu(
    base_cfg: dict[str, Any], full_gpu: None, caplog: pytest.LogCaptureFixture
) -> None:
    from shardforge.train.model import build_meta_model

    cfg = validate_cfg(
        {**base_cfg, "attn_implementation": "sdpa", "bf16": True, "sample_packing_keep_sdpa": True}
    )
    model = build_meta_model(cfg)
    with caplog.at_level(logging.INFO, logger="shardforge"):
        assert use_packed_attention(model, cfg, CUDA) == Choice("sdpa", "transformers")
    assert model.config._attn_implementation == "sdpa"
    assert not model.get_decoder()._forward_pre_hooks
    assert not [r for r in caplog.records if "notice" in r.getMessage()]


def _decoder_calls(decoder: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> Any:
    """The ways a decoder is called with a packed batch: by keyword, positionally, with a
    padding mask of ones (each: its last hidden states)."""
    ones = torch.ones_like(ids)
    return {
        "keywords": decoder(input_ids=ids, position_ids=pos),
        "positional": decoder(ids, None, pos),
        "mask": decoder(input_ids=ids, attention_mask=ones, position_ids=pos),
        "positional mask": decoder(ids, ones, pos),
    }


def test_packed_samples_stay_apart_however_the_decoder_is_called() -> None:
    """varlen_attention, hooked as a run hooks it, and not hooked at all (the boundaries then
    come from the position ids transformers passes to the attention): each sample's hidden
    states equal those of the sample alone. The old hook did nothing when called positionally
    or with a mask, and the attention treated each window as one sequence."""
    ids, pos, samples = _packed_batch()
    alone_model, hooked, bare = _models("sdpa", VARLEN, VARLEN)
    _hooked(hooked, "varlen")
    with torch.no_grad():
        alone = [alone_model.get_decoder()(input_ids=s[None]).last_hidden_state[0] for s in samples]
        for model in (hooked, bare):
            for how, out in _decoder_calls(model.get_decoder(), ids, pos).items():
                for got, want in zip(_split(out.last_hidden_state), alone, strict=True):
                    torch.testing.assert_close(got, want, **TOL, msg=how)


def test_packed_flex_attention_keeps_samples_apart_when_called_positionally_or_with_a_mask(
    flex_uncompiled: None,
) -> None:
    ids, pos, samples = _packed_batch()
    alone_model, flex = _models("sdpa", "flex_attention")
    _hooked(flex, "block_mask")
    with torch.no_grad():
        alone = [alone_model.get_decoder()(input_ids=s[None]).last_hidden_state[0] for s in samples]
        for how, out in _decoder_calls(flex.get_decoder(), ids, pos).items():
            for got, want in zip(_split(out.last_hidden_state), alone, strict=True):
                torch.testing.assert_close(got, want, **TOL, msg=how)


def test_the_hook_marks_the_boundaries_dynamic_only_when_compiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without torch_compile nothing of torch._dynamo is called per batch."""
    calls = []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, d: calls.append(d))
    PackedInputs("varlen").inputs(_positions())
    assert calls == []
    PackedInputs("varlen", dynamic=True).inputs(_positions())
    assert calls == [0]
