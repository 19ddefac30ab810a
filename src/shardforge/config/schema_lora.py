"""The LoRA adapter keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardforge.config.view import ConfigView


class LoraKeys(ConfigView):
    """LoRA adapters."""

    # -- LoRA adapters ---------------------------------------------------------------------------
    adapter: Literal["lora", "qlora"] | None = Field(
        None,
        description="`lora`: train a LoRA adapter on the frozen base model (peft), sharded with "
        "FSDP2 like the model; checkpoints hold only the adapter and its optimizer state. "
        "`qlora` (4-bit base weights) is not supported by train yet.",
    )
    lora_r: int = Field(8, gt=0, description="LoRA rank r (the inner dimension of B @ A).")
    lora_alpha: int = Field(
        16, gt=0, description="LoRA alpha: the update is scaled by lora_alpha / lora_r."
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the LoRA input during training."
    )
    lora_target_modules: list[str] | str | None = Field(
        None,
        description="Module names (or name suffixes, as peft matches them) that get a LoRA "
        "adapter, e.g. [q_proj, v_proj]; a string is a regular expression peft matches "
        "against the whole module name.",
    )
    lora_target_linear: bool = Field(
        False,
        description="Adapt every linear layer except the output layer (peft's `all-linear`), "
        "plus lora_target_modules.",
    )
    lora_modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained in full and saved with the adapter, e.g. [embed_tokens, "
        "lm_head] after adding tokens; tied embeddings stay tied.",
    )
    peft_use_rslora: bool = Field(
        False, description="Rank-stabilised LoRA: scale by lora_alpha / sqrt(lora_r)."
    )
    peft_use_dora: bool = Field(
        False, description="DoRA adapters: not supported by train (must be false or unset)."
    )
    lora_model_dir: str | None = Field(
        None,
        description="A PEFT adapter directory to start training from (train) or to fuse "
        "(merge-lora).",
    )
