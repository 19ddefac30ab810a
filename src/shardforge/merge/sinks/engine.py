"""`--engine transformers`: the literal path (meta-device model, `to_empty`, `dcp.load`,
`save_pretrained`). It holds the whole model in memory; the default engine streams."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardforge.formats.dcp.reader import load_checked


def merge_with_transformers(
    config: Any,
    model_dir: Path,
    to_hf: dict[str, str],
    dtype: torch.dtype,
    out: Path,
    max_shard_size: int | str,
    trust_remote_code: bool,
) -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code, dtype=dtype
        )
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage; tie them again
    sd = model.state_dict()
    target = {key: sd[hf] for key, hf in to_hf.items()}
    load_checked(target, model_dir, no_dist=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
