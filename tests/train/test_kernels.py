"""Axolotl's kernel plugins (train.kernels): on this CPU the run goes on with the same math and
one notice; the CUDA path against stand-ins with the exact signatures of liger-kernel 0.8.5's
and cut-cross-entropy 25.1.1's functions (a keyword they lack fails); an unknown plugin is an
error naming it."""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train import kernels
from shardforge.train.kernels import CCE, HUB, LIGER, apply_kernels
from shardforge.train.loss import token_loss_sum

LIGER_KEYS = {
    "liger_rope": True,
    "liger_rms_norm": True,
    "liger_glu_activation": True,
    "liger_layer_norm": True,
    "liger_fused_linear_cross_entropy": True,
}


def _cfg(**extra: Any) -> Any:
    return validate_cfg({"base_model": "unused", **extra})


def _model() -> Any:
    from transformers import AutoModelForCausalLM

    from helpers.tiny import make_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config("llama", num_hidden_layers=1))


def _batch() -> tuple[dict[str, Any], torch.Tensor]:
    ids = torch.randint(4, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids}, labels


def test_an_unknown_plugin_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"plugins: unknown plugin axolotl\.integrations\.x\.Y"):
        _cfg(plugins=[LIGER, "axolotl.integrations.x.Y"])
    both = _cfg(plugins=[LIGER, CCE], liger_fused_linear_cross_entropy=True)
    with pytest.raises(ConfigError, match="two losses; keep one"):
        kernels.plan(both)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback")
def test_without_cuda_the_run_goes_on_with_one_notice(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(plugins=[LIGER, HUB], use_kernels=True, **LIGER_KEYS)
    model = _model()
    before = {n: type(m) for n, m in model.named_modules()}
    inputs, labels = _batch()
    want = token_loss_sum(model, inputs, labels)
    with caplog.at_level("WARNING", logger="shardforge"):
        apply_kernels(model, cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "shardforge"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("notice: kernels: Liger's layer_norm, rms_norm, rope, swiglu: no ")
    assert "Liger's fused linear cross-entropy: no CUDA GPU; the chunked cross-entropy" in lines[0]
    assert "hub kernels (use_kernels): no CUDA GPU; the model's own modules run instead" in lines[0]
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert torch.allclose(token_loss_sum(model, inputs, labels), want)
    cce = _cfg(plugins=[CCE])  # cut_cross_entropy: on by default with the plugin
    assert kernels.plan(cce).loss == "cce" and kernels.plan(_cfg()).loss is None


# -- the CUDA path, against stand-ins ---------------------------------------------------------------

CALLS: dict[str, Any] = {}


def apply_liger_kernel_to_llama(
    rope: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    model: Any = None,
) -> None:
    CALLS["llama"] = dict(rope=rope, cross_entropy=cross_entropy, rms_norm=rms_norm)
    CALLS["llama"].update(swiglu=swiglu, flce=fused_linear_cross_entropy, model=model)


def _apply_liger_kernel_to_instance(model: Any, **kwargs: Any) -> None:
    """liger 0.8.5's, for the one model type here: the keywords its apply function has."""
    apply_fn = {"llama": apply_liger_kernel_to_llama}[model.config.model_type]
    params = inspect.signature(apply_fn).parameters
    apply_fn(model=model, **{k: v for k, v in kwargs.items() if k in params})


def liger_fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    lse_square_scale: float = 0.0,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: Any = None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_mem_const: int = 1,
) -> torch.Tensor:
    CALLS["flce"] = reduction
    logits = (input @ weight.t()).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    shift: bool = False,
    filter_eps: float | str | None = "high",
    impl: str = "cce",
) -> torch.Tensor:
    CALLS["cce"] = (reduction, shift)
    logits = (e @ c.t()).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA and the packages, as stand-ins."""
    liger = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    functional = types.ModuleType("liger_kernel.transformers.functional")
    transformers._apply_liger_kernel_to_instance = _apply_liger_kernel_to_instance  # type: ignore[attr-defined]
    transformers.functional = functional  # type: ignore[attr-defined]
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy  # type: ignore[attr-defined]
    cce = types.ModuleType("cut_cross_entropy")
    cce.linear_cross_entropy = linear_cross_entropy  # type: ignore[attr-defined]
    for module in (liger, transformers, functional, cce):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: name in sys.modules)
    CALLS.clear()


@pytest.mark.parametrize(
    ("extra", "called"),
    [({"plugins": [LIGER], **LIGER_KEYS}, "flce"), ({"plugins": [CCE]}, "cce")],
)
def test_on_cuda_the_kernels_are_applied(
    on_cuda: None, caplog: pytest.LogCaptureFixture, extra: dict[str, Any], called: str
) -> None:
    model = _model()
    inputs, labels = _batch()
    want = token_loss_sum(model, inputs, labels)
    with caplog.at_level("WARNING", logger="shardforge"):
        apply_kernels(model, _cfg(**extra))
    assert not [r for r in caplog.records if r.name == "shardforge"]
    got = token_loss_sum(model, inputs, labels)
    assert CALLS[called] in ("sum", ("sum", False))
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    if called == "flce":  # the modules patched; the forward and loss stay shardforge's
        assert CALLS["llama"] == {
            "rope": True,
            "cross_entropy": False,
            "rms_norm": True,
            "swiglu": True,
            "flce": False,
            "model": model,
        }
