"""`attn_implementation: varlen_attention`: torch's variable-length attention
(torch.nn.attention.varlen, torch 2.10 and later) as a transformers attention function.

    cu_seqlens(position_ids)   the samples' boundaries over the flattened batch (int32)
    VarlenApi / VARLEN_API     this torch's varlen_attn, called with only the keywords its
                               version takes (scale, window, GQA, v's head size adapted)
    varlen_attention_forward   transformers' attention interface: the samples from the given
                               boundaries, else from the position ids

On CPU (tests, debugging) the same attention runs as sdpa sample by sample: exact, slow.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VARLEN = "varlen_attention"  # shardforge's attn_implementation name for torch's varlen_attn


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 [samples + 1]: where each sample starts in the flattened [B * T] batch, then B * T
    (every row starts a sample)."""
    batch, length = position_ids.shape
    starts = torch.diff(position_ids, dim=-1) != 1
    starts = torch.cat([torch.ones_like(starts[:, :1]), starts], dim=-1).reshape(-1)
    index = starts.nonzero().reshape(-1).to(torch.int32)
    end = torch.tensor([batch * length], dtype=torch.int32, device=position_ids.device)
    return torch.cat([index, end])


@dataclass(frozen=True)
class VarlenApi:
    """torch's `varlen_attn` and the keywords this torch's version of it takes: every call goes
    through `__call__`, which passes only those. The versions in the declared range:

        2.6-2.9   no torch.nn.attention.varlen
        2.10      (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
        2.11      (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1))   causal: window_size (-1, 0)
        2.12-2.14 2.11's and enable_gqa=False, seqused_k, block_table, num_splits (keyword-only)

    Every version returns [total, heads, q's head size] (v of the same head size)."""

    fn: Callable[..., Any]
    params: frozenset[str]

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> VarlenApi:
        return cls(fn, frozenset(inspect.signature(fn).parameters))

    def usable(self) -> bool:
        return bool(self.params & {"is_causal", "window_size"})

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        max_len: int,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        """Causal attention over [total, heads, dim] samples `cu` (GQA: fewer k/v heads; v's head
        size may differ from q's, as in DeepSeek's MLA) -> [total, q heads, v's head size]."""
        dv, dqk = v.shape[-1], q.shape[-1]
        scale = dqk**-0.5 if scale is None else scale  # fixed before any padding
        if dv < dqk:  # the kernel's v has q's head size: zeros, sliced off the output
            v = F.pad(v, (0, dqk - dv))
        elif dv > dqk:  # zeros added to q and k change no score
            q, k = F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk))
        extra: dict[str, Any] = {}
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in self.params:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if "scale" in self.params:
            extra["scale"] = scale
        else:  # the kernel scales by 1/sqrt(head size)
            q = q * (scale * q.shape[-1] ** 0.5)
        if "window_size" in self.params:
            extra["window_size"] = (window - 1 if window else -1, 0)
        elif window:
            raise ValueError("this torch's varlen_attn has no sliding window")
        else:
            extra["is_causal"] = True
        out = self.fn(q, k, v, cu, cu, max_len, max_len, **extra)
        out = out if isinstance(out, torch.Tensor) else out[0]
        return out[..., :dv]


def _varlen_api() -> VarlenApi | None:
    """This torch's varlen_attn (read once, at import: a compiled block then makes no call to
    inspect); None before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenApi.of(varlen_attn)


VARLEN_API = _varlen_api()


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
    """transformers' attention interface: q [B, Hq, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv]
    -> [B, T, Hq, Dv]. Samples are given by `cu_seq_lens_q` (a packed batch, `PackedInputs`),
    else by the `position_ids` transformers passes to every attention (a position that does
    not follow the previous one starts a sample); without either each row is one causal
    sequence (right padding, which no earlier token sees)."""
    if dropout or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(
            "varlen_attention has no attention dropout, soft-capping or sinks; use sdpa or eager"
        )
    batch, heads, length, _ = query.shape
    q, k, v = (
        t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1])
        for t in (query, key, value)
    )
    cu = cu_seq_lens_q
    if cu is None:
        cu = _boundaries(kwargs.get("position_ids"), query.shape, key.shape[2], query.device)
    kernel = kernel_for(query.device)
    if kernel is not None:
        out = kernel(q, k, v, cu, int(max_length_q or length), scaling, sliding_window)
    else:
        out = _per_sample(q, k, v, cu, scaling, sliding_window)
    return out.reshape(batch, length, heads, value.shape[-1]), None


def kernel_for(device: torch.device) -> VarlenApi | None:
    """The kernel for tensors on `device`: this torch's varlen_attn on CUDA; None elsewhere
    (sdpa sample by sample)."""
    return VARLEN_API if device.type == "cuda" else None


def _boundaries(positions: Any, shape: torch.Size, keys: int, device: torch.device) -> torch.Tensor:
    """The samples of a [batch, length] batch without given boundaries: from its position ids
    (restarting positions start a sample: a packed window keeps its samples apart however the
    model was called); without them each row is one sequence."""
    batch, length = shape[0], shape[2]
    packed = isinstance(positions, torch.Tensor) and positions.dim() == 2 and keys == length
    if packed and positions.shape[-1] == length and positions.shape[0] in (1, batch):
        return cu_seqlens(positions.expand(batch, -1))
    return torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)


def register() -> None:
    """Make `varlen_attention` an attn_implementation transformers accepts (no mask builder:
    transformers then builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


register()
