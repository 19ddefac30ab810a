"""Packed attention without a dense mask: how a packed window's samples reach the kernel.

    document_ids(position_ids)          [B, T] the sample each token belongs to (0, 1, ...)
    cu_seqlens(position_ids)            the samples' boundaries over the flattened batch (int32)
    document_block_mask(doc, ...)       flex_attention's BlockMask: causal within a sample
    choose(impl, ...)                   which path a packed batch takes (a `Choice`)
    use_packed_attention(model, cfg, .) decide once at setup; hook the model so that every
                                        packed forward gets its attention inputs
    varlen_attention_forward            `attn_implementation: varlen_attention`: torch's
                                        variable-length attention (torch.nn.attention.varlen)

A packed window (`packing.py`) holds whole samples whose position ids restart at 0. Called with
those position ids and no attention mask, transformers builds a dense [B, 1, T, T] mask for
sdpa and eager (no flash kernel runs on it) by data-dependent steps inside the model. Instead,
once per batch and outside the model (and any compiled block), shardforge hands the attention
what it needs from the position ids:

- flex_attention: a BlockMask built from the document ids (`create_block_mask`, compiled on a
  GPU), passed as the model's `attention_mask` (transformers takes a 4-D BlockMask as it is);
- flash_attention_2/3 and varlen_attention: `cu_seq_lens_q/k` over the flattened batch and
  `max_length_q/k` = sequence_len (an upper bound: a constant, so a compiled block does not
  recompile per batch). transformers infers them from position ids only at batch size 1: with
  micro_batch_size > 1 its flash path would otherwise attend across the samples of a window;
- sdpa: on a GPU the packed batch runs varlen_attention (bf16/fp16; else flash_attention_2
  when the package is installed, bf16/fp16; else flex_attention); only where none of them can
  run (CPU) does it keep transformers' dense mask; either way with a one-time notice;
- eager, and models with sliding-window layers or logit soft-capping: transformers' own masks.

`varlen_attention` on CPU (tests, debugging) runs sdpa sample by sample: exact, slow.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")

VARLEN = "varlen_attention"  # shardforge's attn_implementation name for torch's varlen_attn
FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
HALF = (torch.bfloat16, torch.float16)

Route = Literal["block_mask", "varlen", "transformers"]  # transformers: its own masks


# -- what a packed batch is -----------------------------------------------------------------------


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the sample each token belongs to, 0, 1, ... per row. A new sample starts
    where a position does not follow the previous one (transformers' rule,
    `masking_utils.find_packed_sequence_indices`); a window's padding is a sample of its own."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 [samples + 1]: where each sample starts in the flattened [B * T] batch, then B * T
    (every row starts a sample)."""
    batch, length = position_ids.shape
    starts = torch.diff(position_ids, dim=-1) != 1
    starts = torch.cat([torch.ones_like(starts[:, :1]), starts], dim=-1).reshape(-1)
    index = starts.nonzero().reshape(-1).to(torch.int32)
    end = torch.tensor([batch * length], dtype=torch.int32, device=position_ids.device)
    return torch.cat([index, end])


def document_causal(doc: torch.Tensor) -> Callable[..., torch.Tensor]:
    """flex_attention's mask_mod: a token sees the earlier tokens of its own sample."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return mask_mod


def document_block_mask(doc: torch.Tensor, compile_mask: bool | None = None) -> Any:
    """The BlockMask of `document_causal` for a [B, T] batch of document ids (by a compiled
    `create_block_mask` on a GPU: it then never holds a [T, T] tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = doc.shape
    compiled = doc.device.type == "cuda" if compile_mask is None else compile_mask
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(document_causal(doc), batch, None, length, length, device=doc.device)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., Any]:
    """torch.compile(create_block_mask), made once (torchtitan's way; each batch's mask_mod is
    the same code over another tensor: no recompile)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return cast(Callable[..., Any], torch.compile(create_block_mask))


# -- which path ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """How packed batches run: `impl` the attention implementation the model uses (may differ
    from the requested one: sdpa switched to a kernel without a dense mask), `path` the inputs
    each packed batch gets, `notice` what to tell the user once (empty: nothing)."""

    impl: str
    path: Route
    notice: str = ""


def varlen_missing(device: torch.device) -> str | None:
    """Why torch's varlen_attn cannot run on `device` (None: it can)."""
    try:
        import torch.nn.attention.varlen
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if device.type != "cuda":
        return "torch's varlen_attn runs on CUDA only"
    return None


def flash_attn_installed() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def choose(
    impl: str | None,
    device: torch.device,
    dtype: torch.dtype | None,
    plain: bool = True,
    flash_installed: bool = False,
) -> Choice:
    """The path of packed batches for attention `impl` on `device` computing in `dtype`.
    `plain`: every layer full causal attention without soft-capping (else only transformers'
    own masks are exact); `flash_installed`: the flash_attn package is importable."""
    impl = impl or "sdpa"
    if impl in FLASH or impl == VARLEN:
        return Choice(impl, "varlen")
    if impl == "flex_attention":
        return Choice(impl, "block_mask" if plain else "transformers")
    if impl != "sdpa" or not plain:
        return Choice(impl, "transformers")
    half = dtype in HALF
    if half and varlen_missing(device) is None:
        return Choice(VARLEN, "varlen", _switched(VARLEN, "torch's variable-length attention"))
    if half and device.type == "cuda" and flash_installed:
        return Choice("flash_attention_2", "varlen", _switched("flash_attention_2", "flash-attn"))
    if device.type == "cuda":
        return Choice("flex_attention", "block_mask", _switched("flex_attention", "a BlockMask"))
    return Choice(
        impl,
        "transformers",
        "sample_packing with attn_implementation sdpa on "
        f"{device.type}: transformers builds a dense [batch, 1, sequence_len, sequence_len] "
        "mask for every batch (no kernel without a dense mask runs here: "
        f"{varlen_missing(device)}; flex_attention has no backward on CPU)",
    )


def _switched(impl: str, what: str) -> str:
    return (
        f"sample_packing with attn_implementation sdpa: packed batches run {impl} ({what}, no "
        f"dense mask); set attn_implementation: {impl} to say so, or eager for a dense mask"
    )


def plain_attention(config: Any) -> bool:
    """Every layer of the model is full causal attention without logit soft-capping."""
    layers = getattr(config, "layer_types", None)
    if layers is not None:
        windowed = any(kind != "full_attention" for kind in layers)
    else:
        windowed = getattr(config, "sliding_window", None) is not None and getattr(
            config, "use_sliding_window", True
        )
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    return not windowed and not capped


# -- the model's side -------------------------------------------------------------------------------


class PackedInputs:
    """A forward pre-hook on the model's decoder: a call with position ids and no attention
    mask (a packed batch) gets its attention inputs, built once per batch, here."""

    def __init__(self, path: Route) -> None:
        self.path = path

    def inputs(self, position_ids: torch.Tensor) -> dict[str, Any]:
        """The extra forward arguments of a packed batch with these [B, T] position ids."""
        if self.path == "block_mask":
            return {"attention_mask": document_block_mask(document_ids(position_ids))}
        cu = cu_seqlens(position_ids)
        torch._dynamo.maybe_mark_dynamic(cu, 0)  # samples per batch vary: no recompile
        length = int(position_ids.shape[-1])  # an upper bound of every sample's length
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": length,
            "max_length_k": length,
        }

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        positions = kwargs.get("position_ids")
        if args or positions is None or kwargs.get("attention_mask") is not None:
            return None
        if kwargs.get("past_key_values") is not None:
            return None
        embeds = kwargs.get("input_ids")
        if embeds is None:
            embeds = kwargs.get("inputs_embeds")
        if embeds is None or positions.dim() != 2:
            return None
        positions = positions.expand(embeds.shape[0], -1)
        return args, {**kwargs, **self.inputs(positions)}


def decoder(model: nn.Module) -> nn.Module:
    """The module that takes position ids and builds the masks (LlamaModel of
    LlamaForCausalLM): a loss that calls it directly still gets the packed inputs."""
    get = getattr(model, "get_decoder", None)
    inner = get() if callable(get) else None
    return inner if isinstance(inner, nn.Module) else model


def use_packed_attention(
    model: nn.Module, cfg: ShardforgeConfig, device: torch.device, announce: bool = True
) -> Choice | None:
    """With sample_packing (or eval_sample_packing): choose the path once, switch the model's
    attention where sdpa would build a dense mask, hook its decoder, say so once (`announce`:
    rank 0). None: no packed batches in this run. varlen_attention that cannot run here is a
    ConfigError."""
    from shardforge.train.model import compute_dtypes

    config = getattr(model, "config", None)
    requested = getattr(config, "_attn_implementation", None)
    dtype = compute_dtypes(cfg)[0] or torch.float32
    if requested == VARLEN:
        check_varlen(config, device, dtype)
    if not (cfg.sample_packing or cfg.eval_sample_packing):
        return None
    flash = device.type == "cuda" and flash_attn_installed()
    choice = choose(requested, device, dtype, plain_attention(config), flash)
    if choice.impl != requested:
        model.set_attn_implementation(choice.impl)  # type: ignore[operator]
    if choice.path != "transformers":
        decoder(model).register_forward_pre_hook(PackedInputs(choice.path), with_kwargs=True)
    if announce and choice.notice:
        log.warning("notice: %s", choice.notice)
    if announce:
        log.info("packed attention: %s (%s)", choice.impl, choice.path)
    return choice


def check_varlen(config: Any, device: torch.device, dtype: torch.dtype) -> None:
    """varlen_attention runs here (a GPU with torch's varlen_attn, in bf16/fp16; on CPU sample
    by sample), for this model (no logit soft-capping); else a ConfigError."""
    problems = []
    if device.type == "cuda" and (why := varlen_missing(device)):
        problems.append(f"varlen_attention cannot run here: {why}")
    if device.type == "cuda" and dtype not in HALF:
        problems.append("varlen_attention runs in bf16 or fp16 on a GPU; set bf16: true")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append("varlen_attention has no logit soft-capping (this model uses it)")
    if problems:
        raise ConfigError("attn_implementation", problems)


# -- attn_implementation: varlen_attention ------------------------------------------------------------


def _varlen_params() -> frozenset[str]:
    """The keyword names of this torch's varlen_attn (read once, at import: a compiled block
    then makes no call to inspect)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_PARAMS = _varlen_params()


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float | None,
    window: int | None,
) -> torch.Tensor:
    """torch's varlen_attn over [total, heads, dim] (GPU)."""
    from torch.nn.attention.varlen import varlen_attn

    params = VARLEN_PARAMS
    extra: dict[str, Any] = {"scale": scale}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "window_size" in params:
        extra["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise ValueError("this torch's varlen_attn has no sliding window")
    else:
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    return out if isinstance(out, torch.Tensor) else out[0]


def _per_sample(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    scale: float | None,
    window: int | None,
) -> torch.Tensor:
    """The same attention with sdpa, one sample at a time (CPU: exact, slow)."""
    bounds = cu.tolist()
    out = []
    for start, stop in itertools.pairwise(bounds):
        qs, ks, vs = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        mask = None
        if window:
            i = torch.arange(stop - start, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> [B, T, Hq, D].
    Samples are given by `cu_seq_lens_q` (a packed batch, `PackedInputs`); without them each
    row is one causal sequence (right padding, which no earlier token sees)."""
    if dropout or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            "varlen_attention has no attention dropout, soft-capping or sinks; use sdpa or eager"
        )
    batch, heads, length, dim = query.shape
    q, k, v = (
        t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)
    )
    cu = cu_seq_lens_q
    if cu is None:
        cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=query.device)
    if query.device.type == "cuda":
        out = _kernel(q, k, v, cu, int(max_length_q or length), scaling, sliding_window)
    else:
        out = _per_sample(q, k, v, cu, scaling, sliding_window)
    return out.reshape(batch, length, heads, dim), None


def register() -> None:
    """Make `varlen_attention` an attn_implementation transformers accepts (no mask builder:
    transformers then builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


register()
