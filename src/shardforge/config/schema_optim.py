"""The optimizer and learning-rate schedule keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardforge.config.view import ConfigView


class OptimKeys(ConfigView):
    """Optimizer and schedule."""

    # -- optimization ----------------------------------------------------------------------------
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine, linear or constant."
    )
    warmup_steps: int | None = Field(
        None, ge=0, description="Linear warmup length in optimizer steps."
    )
    warmup_ratio: float | None = Field(
        None, ge=0, lt=1, description="Warmup length as a fraction of all steps."
    )
    optimizer: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field(
        "adamw_torch", description="Optimizer: AdamW (default) or plain SGD."
    )
    adam_beta1: float = Field(0.9, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float | None = Field(
        1.0,
        description="Clip gradients to this global L2 norm over all shards (null or 0: no clip).",
    )
