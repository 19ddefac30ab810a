"""The `fsdp:` block and the keys of the device mesh."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from shardforge.config.view import ConfigView

DType = Literal["float32", "bfloat16", "float16"]


class MixedPrecisionConfig(ConfigView):
    """FSDP2 mixed-precision policy (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""

    override_prefix: ClassVar[str | None] = "fsdp.mixed_precision."

    param_dtype: DType | None = None
    """dtype parameters are cast to for forward/backward compute; null keeps the stored dtype.
    Defaults to bfloat16/float16 when `bf16`/`fp16` is set."""
    reduce_dtype: DType | None = None
    """dtype gradients are reduce-scattered in; null uses param_dtype. float32 is the safe choice
    for bf16 training."""


class FsdpConfig(ConfigView):
    """The `fsdp:` block: how the model is sharded during training."""

    override_prefix: ClassVar[str | None] = "fsdp."

    fsdp_version: Literal[2] = 2
    """FSDP implementation. Only FSDP2 (`fully_shard`) is supported."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (ZeRO-3 style, less memory). false keeps them
    until backward (ZeRO-2 style, less communication)."""
    offload_params: bool = False
    """Keep sharded parameters and gradients on CPU (CPUOffloadPolicy)."""
    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class name(s) of the transformer block each wrapped in its own FSDP unit, e.g.
    LlamaDecoderLayer. Auto-detected from the model's `_no_split_modules` when absent."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward."""
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = "SHARDED_STATE_DICT"
    """SHARDED_STATE_DICT writes DCP checkpoints (merge them with `merge-sharded-fsdp-weights`);
    FULL_STATE_DICT makes the final save a regular Hugging Face model directory."""
    mixed_precision: MixedPrecisionConfig = Field(default_factory=MixedPrecisionConfig)
    """Parameter and gradient-reduction dtypes for FSDP2 mixed precision."""
    hybrid_shard: bool = False
    """HSDP: a 2-D (replicate, shard) device mesh; parameters are sharded within groups of
    `dp_shard_size` ranks (default: the ranks of one machine) and replicated across groups.
    Axolotl's HYBRID_SHARD / hybrid_shard."""

    @model_validator(mode="before")
    @classmethod
    def _one_class_is_a_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("transformer_layer_cls_to_wrap"), str):
            names = data["transformer_layer_cls_to_wrap"]
            data = {**data, "transformer_layer_cls_to_wrap": [n.strip() for n in names.split(",")]}
        return data


class ShardingKeys(ConfigView):
    """How the ranks shard the model."""

    # -- sharding --------------------------------------------------------------------------------
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP2 sharding settings (see FsdpConfig)."""
    dp_shard_size: int | None = Field(None, gt=0)
    """Ranks that shard the parameters among themselves; with fewer than all ranks the rest
    replicate (HSDP, a 2-D mesh). Must divide the world size."""
    dp_replicate_size: int | None = Field(None, gt=0)
    """Replica groups of the HSDP mesh (world size = dp_replicate_size x dp_shard_size)."""
