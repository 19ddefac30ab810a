"""The RoPE row order of Llama's q/k projections: interleaved pairs (Meta, torchtitan) vs halves (HF).

Meta's original Llama code and torchtitan rotate *adjacent* pairs of a head's rows
(rows 0,1 form one complex number, rows 2,3 the next, ...). Hugging Face's ``LlamaAttention``
rotates the *first half* of a head against the *second half*. Converting a torchtitan
``wq``/``wk`` weight to HF therefore reorders each head's rows: the even rows first, then the
odd rows. Columns (the input features) are untouched.

Worked example, one head with head_dim 4, rows named by their torchtitan index:
torchtitan order ``[r0, r1, r2, r3]`` (pairs (r0, r1), (r2, r3)) -> HF order ``[r0, r2, r1, r3]``.
"""

from __future__ import annotations

import torch

from shardforge.errors import CheckpointError


def _check(weight: torch.Tensor, n_heads: int, what: str) -> int:
    if weight.dim() not in (1, 2):
        raise CheckpointError(
            f"{what}: expected a 1-D or 2-D weight, got shape {tuple(weight.shape)}"
        )
    rows = weight.shape[0]
    if n_heads <= 0 or rows % n_heads or (rows // n_heads) % 2:
        raise CheckpointError(
            f"{what}: {rows} rows cannot be split into {n_heads} heads of an even head_dim; "
            "check num_attention_heads / num_key_value_heads in config.json"
        )
    return rows // n_heads


def interleaved_to_half(weight: torch.Tensor, n_heads: int, what: str = "weight") -> torch.Tensor:
    """Reorder each head's rows from interleaved-pair order (torchtitan) to half-split order (HF).

    Returns a new contiguous tensor; `weight` is not modified.
    """
    head_dim = _check(weight, n_heads, what)
    tail = weight.shape[1:]
    return (
        weight.reshape(n_heads, head_dim // 2, 2, *tail)
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def half_to_interleaved(weight: torch.Tensor, n_heads: int, what: str = "weight") -> torch.Tensor:
    """The inverse of `interleaved_to_half`: HF half-split order back to interleaved pairs."""
    head_dim = _check(weight, n_heads, what)
    tail = weight.shape[1:]
    return (
        weight.reshape(n_heads, 2, head_dim // 2, *tail)
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )
