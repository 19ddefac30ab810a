"""Packed attention without a dense mask: how a packed window's samples reach the kernel.

    document_ids(position_ids)          [B, T] the sample each token belongs to (0, 1, ...)
    cu_seqlens(position_ids)            the samples' boundaries over the flattened batch (int32,
                                        from varlen.py)
    document_block_mask(doc, ...)       flex_attention's BlockMask: causal within a sample
    choose(impl, ...)                   which path a packed batch takes (a `Choice`)
    use_packed_attention(model, cfg, .) decide once at setup; hook the model so that every
                                        packed forward gets its attention inputs
    (varlen.py)                         `attn_implementation: varlen_attention`: torch's
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
- sdpa: on a GPU the packed batch runs varlen_attention (bf16/fp16, a torch with varlen_attn
  and its flash kernel, sm80+; else flash_attention_2 when the package is installed,
  bf16/fp16; else flex_attention, with triton); only where none of them can run (CPU) does it
  keep transformers' dense mask; either way with a one-time notice.
  `sample_packing_keep_sdpa: true` keeps sdpa on the dense mask;
- eager, and models with sliding-window layers or logit soft-capping: transformers' own masks.

The hook finds the position ids by keyword or by position; where it cannot act (a mask it
does not know), varlen_attention still splits the samples by the position ids transformers
passes to every attention call.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train.varlen import VARLEN, VARLEN_API, cu_seqlens

log = logging.getLogger("shardforge")

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
    """Why torch's varlen_attn cannot run on `device` (None: it can): this torch has it (2.10
    and later) in a form the adapter can call, the GPU has torch's flash kernel (sm80+)."""
    if VARLEN_API is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not VARLEN_API.usable():
        return f"torch {torch.__version__}'s varlen_attn takes neither is_causal nor window_size"
    if device.type != "cuda":
        return "torch's varlen_attn runs on CUDA only"
    return gpu_missing(device, "varlen_attn")


def gpu_missing(device: torch.device, what: str) -> str | None:
    """Why torch's flash kernel (under varlen_attn) cannot run on the GPU `device`."""
    if not torch.backends.cuda.is_flash_attention_available():
        return f"this torch build has no flash attention kernel for {what}"
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError) as exc:
        return f"no CUDA device here ({type(exc).__name__})"
    if major < 8:
        return f"{what} needs a GPU of compute capability 8.0 or later (this one: {major}.{minor})"
    return None


def flex_missing(device: torch.device) -> str | None:
    """Why flex_attention cannot run compiled on `device` (None: it can): CUDA and triton."""
    if device.type != "cuda":
        return "flex_attention has no backward on CPU"
    if importlib.util.find_spec("triton") is None:
        return "flex_attention needs triton, which is not installed"
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
    varlen_why = varlen_missing(device)
    if half and varlen_why is None:
        return Choice(VARLEN, "varlen", _switched(VARLEN, "torch's variable-length attention"))
    if half and device.type == "cuda" and flash_installed:
        return Choice("flash_attention_2", "varlen", _switched("flash_attention_2", "flash-attn"))
    flex_why = flex_missing(device)
    if flex_why is None:
        return Choice("flex_attention", "block_mask", _switched("flex_attention", "a BlockMask"))
    if device.type == "cpu":  # what every CPU run does: said in one short line
        return Choice(
            impl,
            "transformers",
            "sample_packing with attn_implementation sdpa on "
            "cpu: a dense mask per batch (CPUs run no packed kernel)",
        )
    why = varlen_why if half or device.type != "cuda" else "varlen_attn needs bf16 or fp16"
    return Choice(
        impl,
        "transformers",
        "sample_packing with attn_implementation sdpa on "
        f"{device.type}: transformers builds a dense [batch, 1, sequence_len, sequence_len] "
        f"mask for every batch (no kernel without a dense mask runs here: {why}; {flex_why})",
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
    """A forward pre-hook on the model's decoder: a call with position ids (by keyword or by
    position) gets its packed batch's attention inputs, built once per batch, here. A 2-D
    padding mask is folded in (the BlockMask hides its padding; right padding, a sample of
    its own or the end of the last one, needs nothing more on the varlen route); any other
    mask is left to transformers, and varlen_attention still splits the samples by the
    position ids it is given. `dynamic`: the blocks are compiled (the number of samples per
    batch varies: marked dynamic, no recompile)."""

    def __init__(self, path: Route, dynamic: bool = False) -> None:
        self.path = path
        self.dynamic = dynamic

    def inputs(self, position_ids: torch.Tensor, padding: Any = None) -> dict[str, Any]:
        """The extra forward arguments of a packed batch with these [B, T] position ids
        (`padding`: a [B, T] mask, 0 where a token is padding, for the BlockMask)."""
        if self.path == "block_mask":
            doc = document_ids(position_ids)
            if padding is not None:  # padding: a sample no token sees
                doc = torch.where(padding.bool(), doc, -1 - doc)
            return {"attention_mask": document_block_mask(doc)}
        cu = cu_seqlens(position_ids)
        if self.dynamic:
            torch._dynamo.maybe_mark_dynamic(cu, 0)
        length = int(position_ids.shape[-1])  # an upper bound of every sample's length
        return {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": length,
            "max_length_k": length,
            "attention_mask": None,
        }

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        call = _keywords(module, args, kwargs)
        if call is None or call.get("past_key_values") is not None:
            return None
        positions = call.get("position_ids")
        embeds = call.get("input_ids")
        if embeds is None:
            embeds = call.get("inputs_embeds")
        if positions is None or embeds is None or positions.dim() != 2:
            return None
        mask = call.get("attention_mask")
        if mask is not None and not _right_padding(mask):
            return None
        positions = positions.expand(embeds.shape[0], -1)
        return (), {**call, **self.inputs(positions, mask)}


def _keywords(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's arguments by name (positional ones bound to `module.forward`'s parameters);
    None where they cannot be named."""
    if not args:
        return dict(kwargs)
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    call: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        else:
            call[name] = value
    return call


def _right_padding(mask: Any) -> bool:
    """`mask` is a [B, T] padding mask whose zeros, if any, end each row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    keep = mask.bool()
    return bool((keep[:, 1:] <= keep[:, :-1]).all())


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
    from shardforge.train.compile import compile_enabled
    from shardforge.train.model import compute_dtypes

    config = getattr(model, "config", None)
    requested = getattr(config, "_attn_implementation", None)
    dtype = compute_dtypes(cfg)[0] or torch.float32
    if requested == VARLEN:
        check_varlen(config, device, dtype)
    if not (cfg.sample_packing or cfg.eval_sample_packing):
        return None
    if cfg.sample_packing_keep_sdpa and requested in (None, "sdpa"):
        choice = Choice("sdpa", "transformers")  # the user's choice: no notice
    else:
        flash = device.type == "cuda" and flash_attn_installed()
        choice = choose(requested, device, dtype, plain_attention(config), flash)
    if choice.impl != requested:
        model.set_attn_implementation(choice.impl)  # type: ignore[operator]
    if choice.path != "transformers":
        hook = PackedInputs(choice.path, compile_enabled(cfg))
        decoder(model).register_forward_pre_hook(hook, with_kwargs=True)
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
