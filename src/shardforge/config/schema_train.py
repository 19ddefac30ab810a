"""The training-run keys: precision, speed, checkpoints, evaluation and tracking."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shardforge.config.schema_data import DatasetConfig
from shardforge.config.view import ConfigView

# what a value of 1 or more must be instead (below 1 it is a fraction), per key
_WHOLE_OR_FRACTION = {
    "val_set_size": "a fraction below 1 (0.05) nor a whole number of samples (200)",
    "eval_steps": "a number of steps (50) nor a fraction of all steps below 1 (0.1)",
}


# Axolotl's plugins that shardforge runs: name -> what it brings (train.kernels applies them)
PLUGINS = {
    "axolotl.integrations.liger.LigerPlugin": "Liger kernels (the liger_* keys)",
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": "Cut Cross Entropy",
    "axolotl.integrations.kernels.KernelsPlugin": "hub kernels (use_kernels)",
}
_LIGER_HELP = " (LigerPlugin; on CUDA with liger-kernel, else the model's own math, one notice)"


class PrecisionKeys(ConfigView):
    """Precision and speed."""

    # -- precision -------------------------------------------------------------------------------
    bf16: bool | Literal["auto"] = False
    """Train in bfloat16 mixed precision (`auto`: when the GPU supports it)."""
    fp16: bool = False
    """Train in float16 mixed precision."""
    tf32: bool = False
    """Allow TF32 matmuls on Ampere+ GPUs."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (same as fsdp.activation_checkpointing)."""

    # -- speed -----------------------------------------------------------------------------------
    torch_compile: bool | Literal["auto"] = False
    """Compile each transformer block in place with torch.compile (after activation checkpointing,
    before FSDP2 shards it); the first step compiles, later steps reuse the graphs. `auto`: on (as
    Axolotl with torch >= 2.5.1)."""
    torch_compile_backend: str | None = None
    """torch.compile backend (null: inductor; aot_eager, eager, ...)."""
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = None
    """torch.compile mode (null: default). Exclusive with torch_compile_options."""
    torch_compile_options: dict[str, bool | int | float | str] | None = None
    """torch.compile backend options (inductor's config keys, e.g. {max_autotune: true}). Exclusive
    with torch_compile_mode."""
    sample_packing_keep_sdpa: bool = False
    """With sample_packing (or eval_sample_packing) and attn_implementation sdpa, keep sdpa on
    transformers' dense [batch, 1, sequence_len, sequence_len] mask. By default a GPU run switches
    packed batches to varlen_attention, flash_attention_2 or flex_attention (no dense mask); this
    keeps plain sdpa (a baseline, or a model those kernels do not suit)."""
    chunked_cross_entropy: bool | None = None
    """The loss computes the output head and the cross-entropy over chunks of the sequence (each
    chunk's logits recomputed in backward), so the full logits (tokens x vocabulary, float32) never
    exist at once; same loss and gradients, at the cost of recomputing each chunk's logits in
    backward. null or false: off (Axolotl's default; the gain on a GPU is unmeasured); true: on,
    refused where not exact (the model's forward must end in `logits = lm_head(hidden_states)`, no
    soft-capping or scaling after it)."""
    chunked_cross_entropy_num_chunks: int | None = Field(None, gt=0)
    """Chunks of the sequence the chunked loss uses (null: 8)."""

    # -- kernels (Axolotl's plugins) ---------------------------------------------------------------
    plugins: list[str] | None = None
    """Axolotl plugins: axolotl.integrations.liger.LigerPlugin,
    axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin,
    axolotl.integrations.kernels.KernelsPlugin. Their kernels run on CUDA with their package (the
    `kernels` extra); elsewhere the run goes on with the same math and one notice naming what runs
    instead. Any other plugin is refused."""
    liger_rope: bool | None = Field(None, description="Liger's rotary embedding" + _LIGER_HELP)
    liger_rms_norm: bool | None = Field(None, description="Liger's RMSNorm" + _LIGER_HELP)
    liger_layer_norm: bool | None = Field(None, description="Liger's LayerNorm" + _LIGER_HELP)
    liger_glu_activation: bool | None = Field(
        None, description="Liger's SwiGLU / GeGLU MLP" + _LIGER_HELP
    )
    liger_swiglu: bool | None = Field(
        None, description="Older name of liger_glu_activation" + _LIGER_HELP
    )
    liger_cross_entropy: bool | None = Field(
        None, description="Liger's cross-entropy over the logits" + _LIGER_HELP
    )
    liger_fused_linear_cross_entropy: bool | None = Field(
        None,
        description="Liger's fused output head + cross-entropy (no full logits); elsewhere "
        "the chunked cross-entropy, which has the same aim" + _LIGER_HELP,
    )
    cut_cross_entropy: bool | None = None
    """Cut Cross Entropy's fused output head + cross-entropy (CutCrossEntropyPlugin; null: on with
    the plugin). On CUDA with cut-cross-entropy; elsewhere the chunked cross-entropy, which has the
    same aim, with one notice."""
    use_kernels: bool | None = None
    """transformers' hub kernels (`set_use_kernels`; KernelsPlugin): on CUDA with the kernels
    package and the kernels in the local hub cache; elsewhere the model's own modules, with one
    notice."""

    @field_validator("plugins")
    @classmethod
    def _known_plugins(cls, value: list[str] | None) -> list[str] | None:
        unknown = [p for p in value or [] if p not in PLUGINS]
        if unknown:
            raise ValueError(
                f"unknown plugin {', '.join(unknown)}; shardforge runs {', '.join(PLUGINS)}"
            )
        return value


class CheckpointKeys(ConfigView):
    """When and how the run saves."""

    # -- checkpoints and logging -----------------------------------------------------------------
    save_steps: int | None = Field(None, gt=0)
    """Save a checkpoint every N optimizer steps (and always at the end)."""
    saves_per_epoch: int | None = Field(None, gt=0)
    """Save this many checkpoints per epoch (evenly spaced; sets the save interval from the number
    of steps per epoch). Exclusive with save_steps."""
    save_strategy: Literal["no", "steps", "epoch", "best"] | None = None
    """`no`: the run saves nothing, neither checkpoints nor the final model or adapter (a benchmark
    or a throwaway run; metrics are still written). `epoch`: a checkpoint at the end of each epoch
    (saves_per_epoch: 1). `steps` or null: as save_steps / saves_per_epoch say (and always at the
    end). `best` is not supported."""
    save_total_limit: int | None = Field(None, gt=0)
    """Keep at most this many checkpoints; older ones are deleted."""
    logging_steps: int = Field(1, gt=0)
    """Log loss, lr, grad norm every N steps."""
    resume_from_checkpoint: str | None = None
    """`auto` resumes from the latest complete checkpoint in output_dir; a path resumes from that
    checkpoint."""
    save_only_model: bool = False
    """Checkpoints hold the model, the trainer state and the RNG states but no optimizer state
    (smaller, faster). Resuming from one starts the optimizer afresh (its moments at zero), with a
    warning; as with Hugging Face's Trainer it is no exact resume."""
    save_first_step: bool = False
    """Also save a checkpoint after the first optimizer step."""
    take_over_lock: bool = False
    """Take over output_dir's lock file (output_dir/.shardforge.lock) when it names a run on another
    host that no longer runs (shardforge cannot tell from here). One run at a time writes an
    output_dir: a second is refused, naming the first; the lock of a run of this host that has ended
    is taken over with a notice."""

    @field_validator("save_strategy", mode="before")
    @classmethod
    def _unquoted_no(cls, value: object) -> object:
        """YAML reads an unquoted `no` as false: `save_strategy: no` means "no"."""
        return "no" if value is False else value


class EvalKeys(ConfigView):
    """Evaluation and tracking."""

    # -- evaluation and tracking -----------------------------------------------------------------
    val_set_size: float = Field(0.0, ge=0)
    """Hold out part of the training samples for evaluation: a fraction below 1 (0.05: 5%, rounded
    up) or a whole number of samples (200): the last of the merged samples (shuffled by `seed`),
    before packing, as Axolotl splits them; the same split at any world size. 0: none. Exclusive
    with test_datasets."""
    test_datasets: list[DatasetConfig] = Field(default_factory=list)
    """Evaluation data sets (entries like `datasets`). Exclusive with val_set_size."""
    eval_steps: float | None = Field(None, gt=0)
    """Evaluate every N optimizer steps (a value below 1: every ceil(value x total steps)), and
    before the first step. With evaluation data, training always ends with an evaluation. Exclusive
    with evals_per_epoch."""
    evals_per_epoch: int | None = Field(None, ge=0)
    """Evaluate this many times per epoch (every max(1, steps_per_epoch // N) steps), and before the
    first step. 0 or null: only at the end. Exclusive with eval_steps."""
    eval_batch_size: int | None = Field(None, gt=0)
    """Evaluation sequences per rank per forward pass (default: micro_batch_size). Does not change
    the eval loss beyond float rounding."""
    eval_sequence_len: int | None = Field(None, gt=0)
    """Tokens per evaluation sequence (default: sequence_len)."""
    eval_sample_packing: bool | None = None
    """Pack the evaluation samples into eval_sequence_len windows (default: as sample_packing)."""
    load_best_model_at_end: bool = False
    """At the end, the model of the checkpoint with the best evaluation (metric_for_best_model)
    becomes the final model: the final save writes it. Needs evaluation data and an evaluation at
    every checkpoint (save_steps a multiple of eval_steps); save_total_limit never deletes the best
    checkpoint."""
    metric_for_best_model: str | None = None
    """The evaluation metric that picks the best checkpoint and drives early stopping: loss /
    eval_loss or another key of the evaluation record (eval_ optional). null: eval_loss."""
    greater_is_better: bool | None = None
    """A larger metric is better. null: false for a metric ending in loss, else true (as Hugging
    Face's Trainer)."""
    early_stopping_patience: int | None = Field(None, gt=0)
    """Stop training once this many evaluations in a row have not improved on the best metric
    (Hugging Face's EarlyStoppingCallback); the run ends with its final save. Needs evaluation
    data."""
    use_tensorboard: bool = False
    """Write TensorBoard event files (rank 0) to output_dir/runs (or $TENSORBOARD_LOGGING_DIR).
    Needs `pip install 'shardforge[tracking]'`."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project (rank 0; W&B is on when this is set). Needs `pip
    install 'shardforge[tracking]'`."""
    wandb_entity: str | None = None
    """W&B entity (team or user)."""
    wandb_name: str | None = None
    """W&B run name (display name)."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """W&B mode: online, offline (no network: the run is kept under output_dir/wandb, or $WANDB_DIR,
    for `wandb sync`), disabled. null: W&B's default ($WANDB_MODE, else online)."""
    wandb_run_id: str | None = None
    """W&B run id. Default: a new id, kept in output_dir/tracking.json so a resumed run continues
    the same W&B run."""
    fsdp_diagnostics: bool = False
    """Also log per-phase peak memory (after forward, after backward, after the optimizer step) for
    the first fsdp_diagnostics_steps steps. The sharding summary is logged at every start."""
    fsdp_diagnostics_steps: int = Field(3, gt=0)
    """Steps whose per-phase memory fsdp_diagnostics logs."""

    @field_validator("val_set_size", "eval_steps")
    @classmethod
    def _whole_or_fraction(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value >= 1 and not float(value).is_integer():
            raise ValueError(f"{value} is neither {_WHOLE_OR_FRACTION[str(info.field_name)]}")
        return value


class SaveExtrasKeys(ConfigView):
    """Async saves and merges on save."""

    # -- packing, async saves, merge on save ------------------------------------------------------
    async_save: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save): the shards are
    copied to CPU memory, then training continues while they are written; the checkpoint is renamed
    complete once written. At most one save in flight (the next save and the end of training wait
    for it). Needs CPU memory for one more copy of each rank's model and optimizer shards."""
    merge_on_save: bool | Literal["final"] = False
    """Merge each new checkpoint (true) or only the final one (`final`) into
    output_dir/merged/checkpoint-<step> with merge-sharded-fsdp-weights (a LoRA run: the PEFT
    adapter directory), in a separate low-priority process on rank 0 while training continues. A
    failed merge is logged and does not stop training; the run ends when its merges have
    finished."""
    merge_on_save_max_running: int = Field(1, gt=0)
    """Most merge_on_save merges running at once; later checkpoints wait in a queue (and are not
    pruned by save_total_limit until merged)."""


# the (weight, activation) pairs of Axolotl's QAT that shardforge runs
_QAT_PAIRS = {
    ("int4", None),
    ("int4", "int8"),
    ("int4", "float8_e4m3fn"),
    ("float8_e4m3fn", "float8_e4m3fn"),
}
QuantDType = Literal["int4", "int8", "float8_e4m3fn", "fp8", "float8", "nvfp4", "mxfp4"]


class QatConfig(ConfigView):
    """Axolotl's `qat` block: torchao fake quantization while training."""

    weight_dtype: QuantDType = "int8"
    """Fake-quantized weight layout: int4 or float8_e4m3fn (fp8, float8); int8 (Axolotl's default)
    only with activation_dtype int8 is refused as Axolotl refuses it."""
    activation_dtype: QuantDType | None = None
    """Fake-quantized activations: int8, float8_e4m3fn, or null (none)."""
    group_size: int | None = Field(32, gt=0)
    """Elements per group of the per-group int4 weight quantization."""
    quantize_embedding: bool | None = False
    """Also fake-quantize the input embedding's weights (weight only)."""
    fake_quant_after_n_steps: int | None = Field(None, ge=0)
    """Train without fake quantization for this many steps, then with it."""

    @field_validator("weight_dtype", "activation_dtype")
    @classmethod
    def _float8_spellings(cls, value: str | None) -> str | None:
        return "float8_e4m3fn" if value in ("fp8", "float8") else value

    @model_validator(mode="after")
    def _supported_pair(self) -> QatConfig:
        """The weight / activation pairs Axolotl's QAT builds; the rest refused as it does."""
        pair = (self.weight_dtype, self.activation_dtype)
        if pair in _QAT_PAIRS:
            return self
        if "nvfp4" in pair or "mxfp4" in pair:
            raise ValueError(
                f"weight_dtype {self.weight_dtype}: the MX / NVFP4 formats are not supported "
                "by shardforge's qat; use int4 or float8_e4m3fn"
            )
        raise ValueError(
            f"weight_dtype {pair[0]} with activation_dtype {pair[1]} is not a QAT scheme "
            "(torchao has none); use int4 (activation null, int8 or float8_e4m3fn) or "
            "float8_e4m3fn with float8_e4m3fn"
        )


class TrainingOptionKeys(ConfigView):
    """What is trained and how: frozen parameters, noise, determinism, low precision."""

    unfrozen_parameters: list[str] | None = None
    """Train only the parameters whose names match one of these regexes (re.match from the start; a
    `.` is literal unless followed by `+`); the others are frozen. A trailing [start:end] (or [i])
    trains only those rows of the first dimension (the others' gradients are zeroed), e.g.
    `^model.embed_tokens.weight$[320:]`."""
    neftune_noise_alpha: float | None = Field(None, gt=0)
    """NEFTune: uniform noise of magnitude alpha / sqrt(sequence length x hidden size) added to the
    input embeddings while training (not in evaluation)."""
    full_determinism: bool = False
    """Deterministic algorithms only (torch.use_deterministic_algorithms, cuDNN deterministic,
    CUBLAS_WORKSPACE_CONFIG), as transformers' enable_full_determinism; slower on a GPU."""
    fp32_norms: bool = False
    """Norm layers keep float32 parameters and compute in float32 under mixed precision: each norm
    module gets its own FSDP2 unit with a float32 policy, its output cast back to the compute dtype
    (Axolotl's fp32_norms)."""
    fp32_norm_classes: list[str] | None = None
    """Norm classes fp32_norms applies to: a class name suffix (RMSNorm) or a module.Class name.
    null: RMSNorm and LayerNorm."""
    fp8: bool = False
    """Float8 training of the linear layers with torchao (convert_to_float8_training; the output
    layer and layers whose sizes are not multiples of 16 stay as they are). Needs a CUDA GPU of
    compute capability 8.9 or more (H100, L4, ...); refused elsewhere."""
    fp8_enable_fsdp_float8_all_gather: bool = False
    """With fp8: FSDP2 all-gathers the float8 weights (less traffic)."""
    qat: QatConfig | None = None
    """Quantization-aware training (torchao): the linear layers' weights (and activations) are
    fake-quantized in the forward pass; the saved weights stay plain float tensors, ready for
    post-training quantization."""
