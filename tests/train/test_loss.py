"""The chunked loss: the plain loss and its gradients without the full logits (float32, CPU)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers.tiny import make_model
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.data import IGNORE_INDEX
from shardforge.train.loss import (
    DEFAULT_CHUNKS,
    describe,
    loss_chunks,
    not_exact,
    token_loss_sum,
    token_losses,
)

VOCAB = 331
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama (its own output head) and qwen2 (the head tied to the embedding)."""
    root = tmp_path_factory.mktemp("loss")
    return {
        t: make_model(root / t, t, vocab_size=VOCAB, hidden_size=72) for t in ("llama", "qwen2")
    }


def _load(base: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    model.train()
    return model


def _batch() -> tuple[dict[str, Any], torch.Tensor]:
    """3 rows of 17 tokens: a 5-token prompt (ignored), a row without any target."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 17), generator=gen)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX
    return {"input_ids": ids, "use_cache": False}, labels


def _loss_and_grads(
    model: nn.Module, chunks: int, inputs: dict[str, Any], labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, inputs, labels, chunks)
    loss.backward()
    grads = {n: _local(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).clone()


def _assert_same(model: nn.Module, chunks: int) -> None:
    """The chunked loss and every gradient equal the plain loss's (1e-5)."""
    inputs, labels = _batch()
    plain, want = _loss_and_grads(model, 0, inputs, labels)
    chunked, got = _loss_and_grads(model, chunks, inputs, labels)
    assert plain.dtype == chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, **TOL)
    assert set(got) == set(want) and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, **TOL, msg=name)
    assert "forward" not in model.lm_head.__dict__  # the head is itself again


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("chunks", [1, 3, 8, 40])
def test_chunked_loss_and_gradients_equal_the_plain_ones(
    bases: dict[str, Path], model_type: str, chunks: int
) -> None:
    """16 predicted tokens in 1, 3 (6+6+4), 8 (whole chunks of ignored labels) or 40 chunks
    (more than tokens); the tied head's gradient reaches the embedding."""
    _assert_same(_load(bases[model_type]), chunks)


def test_the_chunked_loss_never_holds_the_full_logits(bases: dict[str, Path]) -> None:
    """The head is called once per chunk on that chunk's hidden states only, in forward and
    again (recomputed) in backward."""
    model = _load(bases["llama"])
    inputs, labels = _batch()
    seen: list[tuple[int, ...]] = []
    original = type(model.lm_head).forward

    def spy(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if self is model.lm_head:
            seen.append(tuple(hidden.shape))
        return original(self, hidden)  # type: ignore[arg-type]

    type(model.lm_head).forward = spy  # type: ignore[method-assign]
    try:
        token_loss_sum(model, inputs, labels, 4).backward()
    finally:
        type(model.lm_head).forward = original  # type: ignore[method-assign]
    assert seen == [(3, 4, 72)] * 8  # 4 chunks in forward, 4 recomputed in backward


def test_evaluation_losses_per_token_are_the_plain_ones(bases: dict[str, Path]) -> None:
    model = _load(bases["qwen2"])
    inputs, labels = _batch()
    with torch.no_grad():
        plain = token_losses(model, inputs, labels, 0)
        chunked = token_losses(model, inputs, labels, 5)
    assert plain.shape == chunked.shape == (3, 16)
    torch.testing.assert_close(chunked, plain, **TOL)
    assert not chunked[1].any()  # a row without targets


@pytest.mark.parametrize("where", ["target", "modules_to_save"])
def test_a_lora_head_gets_the_same_gradients(bases: dict[str, Path], where: str) -> None:
    """peft's LoRA layer on the head (or its trainable copy, modules_to_save) is what the
    chunked loss calls: loss and adapter gradients equal the plain ones."""
    from peft import LoraConfig, inject_adapter_in_model

    model = _load(bases["qwen2"])
    config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
        if where == "target"
        else LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    inject_adapter_in_model(config, model)
    assert type(model.lm_head).__module__.startswith("peft.")
    _assert_same(model, 3)


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_under_fsdp2_with_resharding_after_forward(bases: dict[str, Path], one_rank: None) -> None:
    """The sharded model (one rank; the root and its tied head reshard after forward): the head
    runs inside the root's forward and its backward recomputation, so FSDP2 gathers its weight
    for both and reduces its gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardforge.train.model import build_meta_model, materialize_and_load, shard_model

    cfg = validate_cfg({"base_model": str(bases["qwen2"])})
    model = build_meta_model(cfg)
    shard_model(model, cfg, init_device_mesh("cpu", (1,)))
    materialize_and_load(model, cfg, torch.device("cpu"), 0)
    model.train()
    _assert_same(model, 8)
    reference = _load(bases["qwen2"])  # and both equal the unsharded model's
    inputs, labels = _batch()
    want, _ = _loss_and_grads(reference, 0, inputs, labels)
    got, _ = _loss_and_grads(model, 8, inputs, labels)
    torch.testing.assert_close(got, want, **TOL)


def _cfg(base: Path, **extra: Any) -> Any:
    return validate_cfg({"base_model": str(base), **extra})


def _meta(model_type: str, **config: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, num_hidden_layers=1, **config)
        )


def test_the_chunked_loss_is_off_unless_asked_for(bases: dict[str, Path]) -> None:
    """Axolotl's default (off): its gain on a GPU is unmeasured, its recomputation is not."""
    llama = _load(bases["llama"])
    base = bases["llama"]
    assert not_exact(llama) is None
    assert loss_chunks(_cfg(base), llama) == 0
    assert "chunked_cross_entropy: off" in describe(_cfg(base), llama)
    assert loss_chunks(_cfg(base, chunked_cross_entropy_num_chunks=3), llama) == 0
    assert loss_chunks(_cfg(base, chunked_cross_entropy=True), llama) == DEFAULT_CHUNKS == 8
    on = _cfg(base, chunked_cross_entropy=True, chunked_cross_entropy_num_chunks=3)
    assert loss_chunks(on, llama) == 3
    assert loss_chunks(_cfg(base, chunked_cross_entropy=False), llama) == 0


@pytest.mark.parametrize(
    "model_type,why",
    [
        ("gemma2", "changes the logits after the output head"),  # final logit soft-capping
        ("granite", "changes the logits after the output head"),  # logits_scaling
        ("minicpm3", "changes the hidden states before the output head"),  # scaled hidden
    ],
)
def test_where_chunking_is_not_exact_the_plain_loss_is_used(
    bases: dict[str, Path], model_type: str, why: str
) -> None:
    """Soft-capping, scaling of the logits or of the hidden states before the head: the plain
    loss by default; `chunked_cross_entropy: true` is refused naming the key."""
    model = _meta(model_type)
    assert why in (not_exact(model) or "")
    base = bases["llama"]
    assert loss_chunks(_cfg(base), model) == 0
    with pytest.raises(ConfigError, match=r"^chunked_cross_entropy: .* not be exact for"):
        loss_chunks(_cfg(base, chunked_cross_entropy=True), model)


def test_a_copy_keeps_its_own_forward(bases: dict[str, Path]) -> None:
    """A head whose instance already has a forward of its own gets that one back."""
    model = _load(bases["llama"])
    own = copy.copy(model.lm_head.forward)
    model.lm_head.forward = own
    inputs, labels = _batch()
    token_loss_sum(model, inputs, labels, 2)
    assert model.lm_head.__dict__["forward"] is own
