"""Sample packing without cross-talk: whole samples in `sequence_len` windows, each on its own.

    pieces(length, seq_len)     a sample longer than a window as window-sized pieces
    plan_windows(lengths, n)    which samples go into which window (best fit, in data order)
    position_ids(lengths, n)    positions that restart at 0 for every sample (and the padding)
    check_packing(cfg, model)   the model's attention isolates samples, or a ConfigError

A packed window holds whole samples (a sample longer than `sequence_len` is first cut into
`sequence_len` pieces, each a sample of its own) and its padding. Its position ids restart at 0
at the start of every sample; the model is called with those position ids and no attention
mask. `attention.py` gives the attention the samples' boundaries from them (flex's BlockMask,
cu_seqlens for varlen kernels), else transformers' mask builders
(`masking_utils.find_packed_sequence_indices`) make a dense block-diagonal causal mask (eager,
sdpa on CPU): a token attends only to earlier tokens of its own sample.
The label of a sample's first token is -100, so no sample's first token is predicted from the
previous sample's last token. A window then computes what its samples compute one by one.
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

# attention implementations whose masks (or varlen kernels) honour restarting position ids
ISOLATING_ATTENTION = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "varlen_attention",  # train/attention.py
)
# transformers' mask builders that detect packed sequences from position ids
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def pieces(length: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, stop) of the window-sized pieces of a sample of `length` tokens."""
    return [(i, min(i + seq_len, length)) for i in range(0, length, seq_len)]


def plan_windows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The indices of the samples (each at most `seq_len` long) in each window.

    Best fit in data order: each sample goes into the open window with the least room that
    still fits it (the oldest among equals), else into a new window. Deterministic; windows
    are numbered in the order they are opened and keep their samples in data order.
    """
    windows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, window) of windows with room, sorted
    for i, length in enumerate(lengths):
        assert 0 < length <= seq_len, (length, seq_len)
        at = bisect.bisect_left(room, (length, -1))
        if at < len(room):
            free, w = room.pop(at)
        else:
            free, w = seq_len, len(windows)
            windows.append([])
        windows[w].append(i)
        if free - length > 0:
            bisect.insort(room, (free - length, w))
    return windows


def position_ids(lengths: list[int], seq_len: int) -> list[int]:
    """Positions of a window holding samples of `lengths`: 0, 1, ... for each sample, then
    0, 1, ... for the padding (a segment of its own that no sample attends to)."""
    out = [p for length in lengths for p in range(length)]
    return out + list(range(seq_len - len(out)))


def check_packing(cfg: ShardforgeConfig, model: Any) -> None:
    """With `sample_packing`, the model must isolate the samples of a window: its attention
    implementation is one of ISOLATING_ATTENTION and its modeling code builds the mask with
    transformers' mask builders (which read the packed position ids). ConfigError otherwise."""
    if not cfg.sample_packing:
        return
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in ISOLATING_ATTENTION:
        raise ConfigError(
            "sample_packing",
            [
                f"attn_implementation {impl!r} cannot keep packed samples apart (tokens would "
                f"attend across samples); set attn_implementation to one of "
                f"{', '.join(ISOLATING_ATTENTION)}, or sample_packing: false"
            ],
        )
    modules = {type(m).__module__ for m in model.modules()}
    if not any(
        callable(getattr(sys.modules.get(name), builder, None))
        for name in modules
        for builder in MASK_BUILDERS
    ):
        raise ConfigError(
            "sample_packing",
            [
                f"{type(model).__name__}'s attention code does not build its mask from position "
                "ids (transformers' masking_utils), so packed samples would attend to each "
                "other; set sample_packing: false"
            ],
        )
