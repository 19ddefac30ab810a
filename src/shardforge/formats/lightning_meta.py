"""Lightning's ``meta.pt``: the trainer state beside a sharded (DCP) ``.ckpt/`` folder.

Lightning's FSDP strategy saves the model and optimizers as DCP and everything else of its
checkpoint dict with ``torch.save`` into ``meta.pt``: ``epoch``, ``global_step``, the
``*_version`` strings, loop and callback state (numbers, strings, lists, dicts; a callback's
best score is a tensor). `LIGHTNING_META` is its profile for the allow-list unpickler: plain
values, ``OrderedDict`` and plain tensors, which stay `LocalTensor` descriptions (their bytes
are never read); any other class is refused. `read_lightning_meta` finds its ``data.pkl``
with the checked zip locator, as the rank-file reader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardforge.errors import CheckpointError
from shardforge.formats.torchsave import TENSOR_GLOBALS, read_data_pkl, storage_ref
from shardforge.io.unpickler import Profile, sanitize, torch_size, unpickle

LIGHTNING_META_MAX_BYTES = 64 << 20  # counters, versions and callback state: kilobytes

LIGHTNING_META = Profile(
    what="Lightning meta.pt files",
    globals={**TENSOR_GLOBALS, ("torch", "Size"): torch_size},
    max_bytes=LIGHTNING_META_MAX_BYTES,
    max_memo=1 << 20,
    persistent=storage_ref,
)


def read_lightning_meta(path: str | Path) -> dict[Any, Any]:
    """The dict a Lightning ``meta.pt`` holds, through the allow-list; a one-line
    CheckpointError when it is unreadable, damaged, hostile or not a dict."""
    p = Path(path)
    meta = unpickle(read_data_pkl(p, LIGHTNING_META_MAX_BYTES), str(p), LIGHTNING_META)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: holds a {sanitize(meta)}, not Lightning's metadata dict")
    return meta
