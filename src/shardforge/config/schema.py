"""The one schema for a shardforge YAML config. Every field carries a description.

The schema is strict: an unknown key is an error (with a did-you-mean suggestion, see
``config.errors``), never a silently ignored value. A validated config is read-only and reads
like Axolotl's ``DictDefault`` as well (``cfg.fsdp.offload_params``, ``cfg["base_model"]``,
``cfg.get("key")``): see ``config.view``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_serializer, field_validator, model_validator

from shardforge.config.view import ConfigView

DType = Literal["float32", "bfloat16", "float16"]

# the keys of `storage_options` whose values are secrets (never shown, never dumped)
STORAGE_SECRET_KEYS = ("secret", "token", "aws_secret_access_key", "aws_session_token", "password")

# what a value of 1 or more must be instead (below 1 it is a fraction), per key
_WHOLE_OR_FRACTION = {
    "val_set_size": "a fraction below 1 (0.05) nor a whole number of samples (200)",
    "eval_steps": "a number of steps (50) nor a fraction of all steps below 1 (0.1)",
}


class MixedPrecisionConfig(ConfigView):
    """FSDP2 mixed-precision policy (``torch.distributed.fsdp.MixedPrecisionPolicy``)."""

    override_prefix: ClassVar[str | None] = "fsdp.mixed_precision."

    param_dtype: DType | None = Field(
        None,
        description="dtype parameters are cast to for forward/backward compute; null keeps the "
        "stored dtype. Defaults to bfloat16/float16 when `bf16`/`fp16` is set.",
    )
    reduce_dtype: DType | None = Field(
        None,
        description="dtype gradients are reduce-scattered in; null uses param_dtype. float32 "
        "is the safe choice for bf16 training.",
    )


class FsdpConfig(ConfigView):
    """The `fsdp:` block: how the model is sharded during training."""

    override_prefix: ClassVar[str | None] = "fsdp."

    fsdp_version: Literal[2] = Field(
        2, description="FSDP implementation. Only FSDP2 (`fully_shard`) is supported."
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free the gathered parameters after forward (ZeRO-3 style, less memory). "
        "false keeps them until backward (ZeRO-2 style, less communication).",
    )
    offload_params: bool = Field(
        False, description="Keep sharded parameters and gradients on CPU (CPUOffloadPolicy)."
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        None,
        description="Class name(s) of the transformer block each wrapped in its own FSDP unit, "
        "e.g. LlamaDecoderLayer. Auto-detected from the model's `_no_split_modules` when absent.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block's activations in backward."
    )
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT",
        description="SHARDED_STATE_DICT writes DCP checkpoints (merge them with "
        "`merge-sharded-fsdp-weights`); FULL_STATE_DICT makes the final save a regular "
        "Hugging Face model directory.",
    )
    mixed_precision: MixedPrecisionConfig = Field(
        default_factory=MixedPrecisionConfig,
        description="Parameter and gradient-reduction dtypes for FSDP2 mixed precision.",
    )
    hybrid_shard: bool = Field(
        False,
        description="HSDP: a 2-D (replicate, shard) device mesh; parameters are sharded within "
        "groups of `dp_shard_size` ranks (default: the ranks of one machine) and replicated "
        "across groups. Axolotl's HYBRID_SHARD / hybrid_shard.",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_class_is_a_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("transformer_layer_cls_to_wrap"), str):
            names = data["transformer_layer_cls_to_wrap"]
            data = {**data, "transformer_layer_cls_to_wrap": [n.strip() for n in names.split(",")]}
        return data


DatasetType = Literal["completion", "chat_template", "alpaca", "input_output"]


def names_object_storage(value: object) -> bool:
    """Whether `value` names object storage: ``s3://...``, or that URI folded by a Path
    (``s3:/...``), which read as a local path would become a folder named ``s3:``."""
    return value is not None and str(value).startswith("s3:/")


def local_path(value: str | None, expected: str) -> str | None:
    """`value`, unless it names object storage (read as a local path, ``s3://`` would become a
    folder named ``s3:``)."""
    if names_object_storage(value):
        raise ValueError(
            f"{value}: object storage is supported for output_dir and the merge's "
            f"--checkpoint/--output_path; give {expected} (copy it down first)"
        )
    return value


class DatasetConfig(ConfigView):
    """One entry of `datasets:`: a local data file and how to turn its rows into tokens."""

    override_prefix: ClassVar[str | None] = None

    path: str = Field(
        description="Path to a local .json, .jsonl, .parquet or .txt file (or a directory of them)."
    )
    type: DatasetType = Field(
        "completion",
        description="completion: train on the raw text of `field`; alpaca: instruction/input/"
        "output rows in the Alpaca prompt; input_output: `segments` of text, each with a `label` "
        "(train on it or not); chat_template: render the conversation in `field_messages` with "
        "the chat template.",
    )
    ds_type: Literal["json", "parquet", "text"] | None = Field(
        None, description="File format; inferred from the file extension when absent."
    )
    field: str = Field("text", description="Column holding the text, for type completion.")
    field_messages: str = Field(
        "messages",
        description="Column holding the list of messages, for type chat_template.",
    )
    message_property_mappings: dict[str, str] = Field(
        default_factory=lambda: {"role": "role", "content": "content"},
        description="For chat_template: which key of each message holds the role and the "
        "content, e.g. {role: from, content: value} for ShareGPT-style rows.",
    )
    roles: dict[str, list[str]] | None = Field(
        None,
        description="For chat_template: the role names of the data mapped to template roles, "
        "e.g. {user: [human], assistant: [gpt]}. Unmapped roles are kept as they are.",
    )
    roles_to_train: list[str] = Field(
        default_factory=lambda: ["assistant"],
        description="For chat_template: the (mapped) roles whose turns are trained on, unless "
        "train_on_inputs is set.",
    )
    split: str = Field(
        "train",
        description="Split to read, with an optional slice as in `datasets`: train, "
        "train[:20%], train[10:200], train[50%:]. A local file is the split `train`.",
    )

    @field_validator("path")
    @classmethod
    def _local_file(cls, value: str) -> str:
        return local_path(value, "a local data file") or value

    @model_validator(mode="before")
    @classmethod
    def _axolotl_message_fields(cls, data: object) -> object:
        """Axolotl's older `message_field_role` / `message_field_content` spellings."""
        if not isinstance(data, dict):
            return data
        legacy = {"message_field_role": "role", "message_field_content": "content"}
        if not any(k in data for k in legacy):
            return data
        data = dict(data)
        mapping = dict(data.get("message_property_mappings") or {"role": "role"})
        mapping.setdefault("content", "content")
        for key, prop in legacy.items():
            if key in data:
                value = data.pop(key)
                if value is not None:
                    mapping[prop] = value
        data["message_property_mappings"] = mapping
        return data


class ShardforgeConfig(ConfigView):
    """A shardforge config: one YAML file drives `train`, `merge-sharded-fsdp-weights` and more."""

    # -- model -----------------------------------------------------------------------------------
    base_model: str = Field(
        description="Local directory or Hugging Face hub id of the base model (weights, config, "
        "tokenizer)."
    )
    base_model_config: str | None = Field(
        None, description="Where to read config.json from, when not from base_model."
    )
    tokenizer_config: str | None = Field(
        None, description="Where to read the tokenizer from, when not from base_model."
    )
    trust_remote_code: bool = Field(
        False,
        description="Allow model/tokenizer code shipped with the model to run. Off by default.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for chat_template data sets and the saved tokenizer: a name "
        "of Axolotl's (see docs/config.md: chatml, llama3, gemma3, qwen3, tokenizer_default, "
        "tokenizer_default_fallback_<name>, jinja, ...) or Jinja text (containing `{%` or "
        "`{{`). null: the tokenizer's own. train refuses an unknown name; the merge keeps the "
        "tokenizer's own template then.",
    )
    chat_template_jinja: str | None = Field(
        None,
        description="The Jinja text (or a file holding it) used when `chat_template: jinja` or "
        "unset.",
    )
    attn_implementation: str | None = Field(
        None,
        description="Attention kernel passed to transformers: eager, sdpa, flex_attention, "
        "flash_attention_2, ..., or varlen_attention (shardforge's: torch's variable-length "
        "attention, GPU, bf16/fp16) (null: the transformers default). With sample_packing, "
        "sdpa switches to one without a dense mask where one runs (docs/train.md). Axolotl's "
        "flash_attention / sdp_attention / eager_attention / flex_attention flags set it.",
    )
    special_tokens: dict[str, str] | None = Field(
        None,
        description="Tokenizer special tokens to set, e.g. {pad_token: '<|pad|>', eos_token: "
        "'<|im_end|>'}; new ones are added to the vocabulary (embeddings resized before "
        "sharding) and saved with the tokenizer.",
    )
    tokens: list[str] | None = Field(
        None,
        description="Extra tokens added to the tokenizer's vocabulary (embeddings resized "
        "before sharding).",
    )
    eot_tokens: list[str] | None = Field(
        None,
        description="End-of-turn tokens of the chat template: each must be a single token; in "
        "trained turns they are trained on (added as special tokens when missing).",
    )
    output_dir: str = Field(
        "./model-out",
        description="Where training writes checkpoints; where the merge looks for them.",
    )
    storage_options: dict[str, Any] | None = Field(
        None,
        description="Options of the object store for s3:// paths (output_dir, --checkpoint, "
        "--output_path): s3fs keywords such as endpoint_url, key, secret, client_kwargs; what "
        "is not set comes from the AWS environment variables (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL). Secrets are never shown: a dump of the "
        "config (validate, tracking) has *** in their place; prefer the environment for them.",
    )
    seed: int = Field(42, description="Random seed for model init, data order and dropout.")

    # -- data ------------------------------------------------------------------------------------
    datasets: list[DatasetConfig] = Field(
        default_factory=list, description="Training data sets (local files)."
    )
    train_on_inputs: bool = Field(
        False,
        description="Also train on prompt tokens (alpaca instruction/input, unlabelled "
        "input_output segments, chat turns of roles not in roles_to_train).",
    )
    sequence_len: int = Field(2048, gt=0, description="Maximum tokens per training sequence.")
    sample_packing: bool = Field(
        False,
        description="Pack several whole samples into each sequence_len window instead of "
        "padding each; each sample attends only to itself (position ids restart per sample; "
        "needs an attn_implementation that honours them: eager, sdpa, flex_attention, "
        "flash_attention_2/3, varlen_attention).",
    )
    dataset_prepared_path: str | None = Field(
        None,
        description="Folder of prepared data sets (tokenized, templated, masked, packed), one "
        "sub-folder per hash of the data files, the tokenizer and the keys that change "
        "tokens: `shardforge preprocess` writes it, `train` reuses a matching one (else "
        "prepares and writes it, saying why). null: train prepares the data in memory.",
    )
    micro_batch_size: int = Field(1, gt=0, description="Sequences per rank per forward pass.")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-batches accumulated per optimizer step."
    )
    num_epochs: float = Field(1, gt=0, description="Passes over the data set (if max_steps unset).")
    max_steps: int | None = Field(
        None, gt=0, description="Stop after this many optimizer steps (overrides num_epochs)."
    )

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

    # -- precision -------------------------------------------------------------------------------
    bf16: bool | Literal["auto"] = Field(
        False, description="Train in bfloat16 mixed precision (`auto`: when the GPU supports it)."
    )
    fp16: bool = Field(False, description="Train in float16 mixed precision.")
    tf32: bool = Field(False, description="Allow TF32 matmuls on Ampere+ GPUs.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in backward (same as fsdp.activation_checkpointing).",
    )

    # -- speed -----------------------------------------------------------------------------------
    torch_compile: bool | Literal["auto"] = Field(
        False,
        description="Compile each transformer block in place with torch.compile (after "
        "activation checkpointing, before FSDP2 shards it); the first step compiles, later "
        "steps reuse the graphs. `auto`: on (as Axolotl with torch >= 2.5.1).",
    )
    torch_compile_backend: str | None = Field(
        None, description="torch.compile backend (null: inductor; aot_eager, eager, ...)."
    )
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = Field(
        None,
        description="torch.compile mode (null: default). Exclusive with torch_compile_options.",
    )
    torch_compile_options: dict[str, bool | int | float | str] | None = Field(
        None,
        description="torch.compile backend options (inductor's config keys, e.g. "
        "{max_autotune: true}). Exclusive with torch_compile_mode.",
    )
    chunked_cross_entropy: bool | None = Field(
        None,
        description="The loss computes the output head and the cross-entropy over chunks of "
        "the sequence (each chunk's logits recomputed in backward), so the full logits "
        "(tokens x vocabulary, float32) never exist at once; same loss and gradients. null: "
        "on where exact (the model's forward ends in `logits = lm_head(hidden_states)`, no "
        "soft-capping or scaling after it), else the plain loss; true: on, refused where not "
        "exact; false: the plain loss.",
    )
    chunked_cross_entropy_num_chunks: int | None = Field(
        None, gt=0, description="Chunks of the sequence the chunked loss uses (null: 8)."
    )

    # -- checkpoints and logging -----------------------------------------------------------------
    save_steps: int | None = Field(
        None, gt=0, description="Save a checkpoint every N optimizer steps (and always at the end)."
    )
    saves_per_epoch: int | None = Field(
        None,
        gt=0,
        description="Save this many checkpoints per epoch (evenly spaced; sets the save "
        "interval from the number of steps per epoch). Exclusive with save_steps.",
    )
    save_strategy: Literal["no", "steps", "epoch", "best"] | None = Field(
        None,
        description="`no`: the run saves nothing, neither checkpoints nor the final model or "
        "adapter (a benchmark or a throwaway run; metrics are still written). `epoch`: a "
        "checkpoint at the end of each epoch (saves_per_epoch: 1). `steps` or null: as "
        "save_steps / saves_per_epoch say (and always at the end). `best` is not supported.",
    )
    save_total_limit: int | None = Field(
        None, gt=0, description="Keep at most this many checkpoints; older ones are deleted."
    )
    logging_steps: int = Field(1, gt=0, description="Log loss, lr, grad norm every N steps.")
    resume_from_checkpoint: str | None = Field(
        None,
        description="`auto` resumes from the latest complete checkpoint in output_dir; a path "
        "resumes from that checkpoint.",
    )
    take_over_lock: bool = Field(
        False,
        description="Take over output_dir's lock file (output_dir/.shardforge.lock) when it "
        "names a run on another host that no longer runs (shardforge cannot tell from here). "
        "One run at a time writes an output_dir: a second is refused, naming the first; the "
        "lock of a run of this host that has ended is taken over with a notice.",
    )

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

    # -- sharding --------------------------------------------------------------------------------
    fsdp: FsdpConfig = Field(
        default_factory=FsdpConfig, description="FSDP2 sharding settings (see FsdpConfig)."
    )
    dp_shard_size: int | None = Field(
        None,
        gt=0,
        description="Ranks that shard the parameters among themselves; with fewer than all "
        "ranks the rest replicate (HSDP, a 2-D mesh). Must divide the world size.",
    )
    dp_replicate_size: int | None = Field(
        None,
        gt=0,
        description="Replica groups of the HSDP mesh (world size = dp_replicate_size x "
        "dp_shard_size).",
    )

    # -- evaluation and tracking -----------------------------------------------------------------
    val_set_size: float = Field(
        0.0,
        ge=0,
        description="Hold out part of the training samples for evaluation: a fraction below 1 "
        "(0.05: 5%, rounded up) or a whole number of samples (200). Chosen by `seed`, before "
        "packing; the same split at any world size. 0: none. Exclusive with test_datasets.",
    )
    test_datasets: list[DatasetConfig] = Field(
        default_factory=list,
        description="Evaluation data sets (entries like `datasets`). Exclusive with val_set_size.",
    )
    eval_steps: float | None = Field(
        None,
        gt=0,
        description="Evaluate every N optimizer steps (a value below 1: every ceil(value x "
        "total steps)), and before the first step. With evaluation data, training always "
        "ends with an evaluation. Exclusive with evals_per_epoch.",
    )
    evals_per_epoch: int | None = Field(
        None,
        ge=0,
        description="Evaluate this many times per epoch (every max(1, steps_per_epoch // N) "
        "steps), and before the first step. 0 or null: only at the end. Exclusive with "
        "eval_steps.",
    )
    eval_batch_size: int | None = Field(
        None,
        gt=0,
        description="Evaluation sequences per rank per forward pass (default: "
        "micro_batch_size). Does not change the eval loss beyond float rounding.",
    )
    eval_sequence_len: int | None = Field(
        None, gt=0, description="Tokens per evaluation sequence (default: sequence_len)."
    )
    eval_sample_packing: bool | None = Field(
        None,
        description="Pack the evaluation samples into eval_sequence_len windows (default: "
        "as sample_packing).",
    )
    use_tensorboard: bool = Field(
        False,
        description="Write TensorBoard event files (rank 0) to output_dir/runs (or "
        "$TENSORBOARD_LOGGING_DIR). Needs `pip install 'shardforge[tracking]'`.",
    )
    wandb_project: str | None = Field(
        None,
        description="Log to Weights & Biases under this project (rank 0; W&B is on when this "
        "is set). Needs `pip install 'shardforge[tracking]'`.",
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team or user).")
    wandb_name: str | None = Field(None, description="W&B run name (display name).")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="W&B mode: online, offline (no network: the run is kept under "
        "output_dir/wandb, or $WANDB_DIR, for `wandb sync`), disabled. null: W&B's default "
        "($WANDB_MODE, else online).",
    )
    wandb_run_id: str | None = Field(
        None,
        description="W&B run id. Default: a new id, kept in output_dir/tracking.json so a "
        "resumed run continues the same W&B run.",
    )
    fsdp_diagnostics: bool = Field(
        False,
        description="Also log per-phase peak memory (after forward, after backward, after the "
        "optimizer step) for the first fsdp_diagnostics_steps steps. The sharding summary is "
        "logged at every start.",
    )
    fsdp_diagnostics_steps: int = Field(
        3, gt=0, description="Steps whose per-phase memory fsdp_diagnostics logs."
    )

    # -- packing, async saves, merge on save ------------------------------------------------------
    async_save: bool = Field(
        False,
        description="Write checkpoints in the background (torch.distributed.checkpoint."
        "async_save): the shards are copied to CPU memory, then training continues while "
        "they are written; the checkpoint is renamed complete once written. At most one save "
        "in flight (the next save and the end of training wait for it). Needs CPU memory for "
        "one more copy of each rank's model and optimizer shards.",
    )
    merge_on_save: bool | Literal["final"] = Field(
        False,
        description="Merge each new checkpoint (true) or only the final one (`final`) into "
        "output_dir/merged/checkpoint-<step> with merge-sharded-fsdp-weights (a LoRA run: the "
        "PEFT adapter directory), in a separate low-priority process on rank 0 while training "
        "continues. A failed merge is logged and does not stop training; the run ends when "
        "its merges have finished.",
    )
    merge_on_save_max_running: int = Field(
        1,
        gt=0,
        description="Most merge_on_save merges running at once; later checkpoints wait in a "
        "queue (and are not pruned by save_total_limit until merged).",
    )

    @field_serializer("storage_options")
    def _secrets_hidden(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """A dump (validate, tracking, a saved config) never holds a secret."""
        if value is None:
            return None
        return {k: "***" if k in STORAGE_SECRET_KEYS and v else v for k, v in value.items()}

    @field_validator(
        "base_model", "base_model_config", "tokenizer_config", "dataset_prepared_path",
        "lora_model_dir",
    )  # fmt: skip
    @classmethod
    def _local_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        """These keys are read (or written) as local paths (the model's: or hub ids)."""
        hub = info.field_name in ("base_model", "base_model_config", "tokenizer_config")
        return local_path(value, "a local path or hub id" if hub else "a local path")

    @field_validator("val_set_size", "eval_steps")
    @classmethod
    def _whole_or_fraction(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value >= 1 and not float(value).is_integer():
            raise ValueError(f"{value} is neither {_WHOLE_OR_FRACTION[str(info.field_name)]}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ShardforgeConfig:
        """Keys that exclude each other; the first conflict found is the error."""
        if self.val_set_size and self.test_datasets:
            raise ValueError("val_set_size and test_datasets are both set; evaluate on one of them")
        for first, second, conflict in (
            ("eval_steps", "evals_per_epoch", self.eval_steps is not None and self.evals_per_epoch),
            ("bf16", "fp16", self.bf16 is True and self.fp16),
            ("warmup_steps", "warmup_ratio", None not in (self.warmup_steps, self.warmup_ratio)),
            ("save_steps", "saves_per_epoch", None not in (self.save_steps, self.saves_per_epoch)),
            (
                "torch_compile_mode",
                "torch_compile_options",
                self.torch_compile_mode is not None and self.torch_compile_options,
            ),
        ):
            if conflict:
                raise ValueError(f"{first} and {second} are both set; choose one")
        self._consistent_saves()
        return self

    def _consistent_saves(self) -> None:
        """save_strategy against the keys that say when to save."""
        if self.save_strategy == "no":
            for key in ("save_steps", "saves_per_epoch", "merge_on_save"):
                if getattr(self, key):
                    raise ValueError(
                        f"save_strategy: no saves nothing, but {key} is set; remove one of them"
                    )
        if self.save_strategy == "epoch":
            for key in ("save_steps", "saves_per_epoch"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"save_strategy: epoch saves once per epoch, but {key} is set; choose one"
                    )
