"""The rows of the Axolotl key tables (`axolotl_status`): what shardforge does with one key,
the helpers that write a row, and the notes many rows share."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

Status = Literal["implemented", "ignored", "unsupported"]


class AxolotlKey(NamedTuple):
    """One Axolotl key: what shardforge does with it."""

    status: Status
    # implemented: "" or how it maps; ignored: why it has no effect; unsupported: the feature
    note: str = ""
    # a value equal to it (or null) is a placeholder that changes nothing
    default: Any = None
    # implemented under another shardforge key (dotted), e.g. "fsdp" or "attn_implementation"
    ours: str | None = None
    # implemented, except these values: `train` refuses them as the feature `note` names
    refused: tuple[Any, ...] = ()


class _Schema:
    """The placeholder is Axolotl's own default (`axolotl_keys`)."""


SCHEMA: Any = _Schema()


def _i(
    note: str = "", default: Any = SCHEMA, ours: str | None = None, refused: tuple[Any, ...] = ()
) -> AxolotlKey:
    return AxolotlKey("implemented", note, default, ours, refused)


def _g(note: str, default: Any = SCHEMA) -> AxolotlKey:
    return AxolotlKey("ignored", note, default)


def _u(note: str, default: Any = SCHEMA) -> AxolotlKey:
    return AxolotlKey("unsupported", note, default)


def _only(trigger: str, feature: str) -> AxolotlKey:
    """A key Axolotl reads only when `trigger` turns its feature on; train refuses `trigger`,
    so the key alone changes nothing."""
    return _g(f"read only with {trigger} ({feature}), which train refuses")


# Notes shared by many rows.
_TRACKING = "this tracker is not supported (TensorBoard and W&B are); metrics go to metrics.jsonl"
_PREPROCESS = "dataset caching/preprocessing; shardforge tokenizes in memory at start"
_HUB = "nothing is pushed"
_BENCH = "benchmark evaluation is not run; evaluation reports the eval loss and perplexity"
_GEN_EVAL = "generation metrics are not computed; evaluation reports eval loss and perplexity"
_EVAL_SCHEDULE = "evaluation runs every eval_steps / evals_per_epoch (if set) and at the end"
_FLOAT32 = (
    "Axolotl does not read it (its weights are float32 unless bf16 / bfloat16 / fp16 / float16);"
    " shardforge keeps float32 weights unless bfloat16 / float16"
)
_WANDB_EXTRAS = "W&B logs the metrics only (no model artifacts, no gradient watching)"
_SPEED = "speed only; does not change the trained weights"
_MEMORY = "memory use only; does not change the trained weights"
_LAUNCHER = "set by the launcher; shardforge reads the torchrun environment"
_DDP = "DDP setting; shardforge trains with FSDP2"
_INTERNAL = "internal to Axolotl"
_SAMPLES = "sample generation during training is not supported; it does not change the weights"
_LORA = "LoRA/QLoRA adapters"
_RL = "reinforcement learning (DPO/KTO/ORPO/GRPO)"
_REWARD = "reward model training"
_LIGER = "Liger kernels"
_LIGER_ON = (
    "with LigerPlugin: liger-kernel on CUDA, else the model's own modules (one notice); the "
    "fused loss: else the chunked cross-entropy"
)
_DEEPSPEED = "DeepSpeed (shardforge uses FSDP2)"
_MOE_PLUGIN = "MoE kernels and quantization (plugin)"
_EXPERT_PARALLEL = "expert parallelism (plugin)"
_MULTIMODAL = "multimodal training"
_QGALORE = "Q-GaLore optimizer"
_KD = "knowledge distillation (plugin)"
_NEMO = "NeMo Gym environments (plugin)"
_MULTIPACK = "multipack packing options"
_MIXLORA = "MixLoRA adapters"
_BALANCE = "balancing supervised tokens across batches"
_DIFFUSION = "diffusion language model training"
_STEPWISE = "stepwise supervised (process reward) datasets"
_ONLY_TYPES = (
    "read only by the data set types of preference, distillation and stepwise data, which "
    "train refuses; the types train reads do not read it"
)
_FSDP2_MOOT = "no meaning under FSDP2"
_FSDP2_MOOT_WRAP = "no meaning under FSDP2; each transformer block is its own unit"
_DROPPED = "not an Axolotl 0.21 key: Axolotl drops it"
_FSDP1 = "FSDP1 only; Axolotl 0.21 drops it too"
