"""What shardforge does with each key of Axolotl's config: decided here, by hand.

The keys themselves, with Axolotl's defaults, are `axolotl_keys.py`, generated from Axolotl's
released package (cicd/gen_axolotl_keys.py); the tests fail when a key there has no decision
here, or a decision names a key Axolotl no longer has. A key's status says what shardforge does
with it:

- implemented: same name, or `ours`; `refused` values are a feature `train` does not have;
- ignored: accepted with a notice: it cannot change the trained weights or the saved files;
- unsupported: `train` refuses a value other than a placeholder (null, an empty value or
  Axolotl's default; a flag whose Axolotl default is null means off, so false is one too).

`LEGACY_*` are keys Axolotl 0.21 does not define but its own example configs and docs still
carry (older spellings and options, FSDP1 settings). Axolotl's schema ignores a key it does not
define (pydantic's default, `extra="ignore"`: the key is dropped from the validated config), so
they have no effect there; shardforge names them in the ignored notice, or reads the older
spelling where it implements the feature. Any other key that is neither Axolotl's nor ours is
ignored the same way, unless it is a near miss of a known key (an error with a did-you-mean).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from shardforge.config.axolotl_keys import (
    DATASET_FIELDS,
    FSDP_CONFIG_FIELDS,
    TOP_LEVEL_FIELDS,
    AxolotlField,
)

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

# Every top-level key of Axolotl's config.
TOP_LEVEL_STATUS: dict[str, AxolotlKey] = {
    "accelerator_config": _u("Accelerate AcceleratorConfig overrides"),
    "activation_offloading": _g(_MEMORY),
    "adam_beta1": _i(),
    "adam_beta2": _i(),
    "adam_beta3": _only("optimizer: came_pytorch", "CAME optimizer"),
    "adam_epsilon": _i(),
    "adam_epsilon2": _only("optimizer: came_pytorch", "CAME optimizer"),
    "adapter": _i("lora, or qlora (over 4-bit NF4 base weights; the quant extra)"),
    "added_tokens_overrides": _u("renaming reserved added tokens"),
    "attn_implementation": _i(),
    "auto_find_batch_size": _u("automatic batch size search"),
    "auto_resume_from_checkpoints": _u("automatic resume (use resume_from_checkpoint: auto)"),
    "autotune_cache_path": _g(_SPEED),
    "autotune_neighborhood": _g(_SPEED),
    "autotune_profiles": _g(_SPEED),
    "axolotl_config_path": _g(_INTERNAL),
    "balance_labels": _u(_BALANCE),
    "base_model": _i(),
    "base_model_config": _i(),
    "batch_flattening": _g(_SPEED),
    "batch_size": _u("global batch_size (use gradient_accumulation_steps)"),
    "bench_dataset": _g(_BENCH),
    "bench_split": _g(_BENCH),
    "bf16": _i(),
    "bfloat16": _i(),
    "bnb_config_kwargs": _i("read as the settings of torchao's NF4 / int8 base weights"),
    "center_rewards_coefficient": _only(
        "reward_model / process_reward_model", "reward model training"
    ),
    "chat_template": _i(),
    "chat_template_jinja": _i(),
    "chat_template_kwargs": _i(),
    "chunked_cross_entropy": _i(
        "off by default, as in Axolotl; `true`: the same loss without the full logits"
    ),
    "chunked_cross_entropy_num_chunks": _i(),
    "cls_model_config": _u("custom model config class"),
    "comet_api_key": _g(_TRACKING),
    "comet_experiment_config": _g(_TRACKING),
    "comet_experiment_key": _g(_TRACKING),
    "comet_mode": _g(_TRACKING),
    "comet_online": _g(_TRACKING),
    "comet_project_name": _g(_TRACKING),
    "comet_workspace": _g(_TRACKING),
    "context_parallel": _u("context parallelism"),
    "context_parallel_size": _u("context parallelism", default=1),
    "coreweave": _u("CoreWeave integration (plugin)"),
    "cosine_constant_lr_ratio": _i("cosine: the floor is reached at this fraction of the steps"),
    "cosine_min_lr_ratio": _i("cosine and rex: decay to this fraction of the peak lr"),
    "cpo_alpha": _only("rl", "reinforcement learning"),
    "curriculum_sampling": _u("sequential (curriculum) sampling"),
    "cut_cross_entropy": _i(
        "with CutCrossEntropyPlugin: cce on CUDA, else the chunked cross-entropy (one notice)",
        default=False,
    ),
    "cut_cross_entropy_accum_c_fp32": _u("Cut Cross Entropy (plugin)"),
    "cut_cross_entropy_c_grad_chunk_size": _u("Cut Cross Entropy (plugin)"),
    "dataloader_drop_last": _i(),
    "dataloader_num_workers": _g(_SPEED),
    "dataloader_pin_memory": _g(_SPEED),
    "dataloader_prefetch_factor": _g(_SPEED),
    "dataset_exact_deduplication": _i(),
    "dataset_keep_in_memory": _g(_PREPROCESS),
    "dataset_num_proc": _g(_PREPROCESS),
    "dataset_prepared_path": _i("shardforge preprocess writes it, train reuses it"),
    "dataset_processes": _g(_PREPROCESS),
    "dataset_shard_idx": _i(),
    "dataset_shard_num": _i(),
    "datasets": _i(),
    "ddp": _g(_LAUNCHER),
    "ddp_broadcast_buffers": _g(_DDP),
    "ddp_bucket_cap_mb": _g(_DDP),
    "ddp_find_unused_parameters": _g(_DDP),
    "ddp_timeout": _g(_DDP),
    "deepcompile": _u(_DEEPSPEED),
    "deepspeed": _u(_DEEPSPEED),
    "default_system_message": _i(),
    "dense_mixer": _u("DenseMixer MoE routing (plugin)", default=False),
    "device": _g(_LAUNCHER),
    "device_map": _g("model placement; FSDP2 shards the model across ranks"),
    "diffusion": _u("diffusion language model training (plugin)"),
    "diffusion_decision": _u(_DIFFUSION),
    "diffusion_lm": _u(_DIFFUSION),
    "dion_lr": _only("optimizer: dion", "Dion optimizer"),
    "dion_momentum": _only("optimizer: dion", "Dion optimizer"),
    "dion_rank_fraction": _only("optimizer: dion", "Dion optimizer"),
    "dion_rank_multiple_of": _only("optimizer: dion", "Dion optimizer"),
    "do_bench_eval": _g(_BENCH),
    "do_causal_lm_eval": _g(_GEN_EVAL),
    "dp_replicate_size": _i(),
    "dp_shard_size": _i(),
    "dpo_beta": _only("rl", "reinforcement learning"),
    "dpo_generate_during_eval": _only("rl", "reinforcement learning"),
    "dpo_label_smoothing": _only("rl", "reinforcement learning"),
    "dpo_ld_alpha": _only("rl", "reinforcement learning"),
    "dpo_loss_type": _only("rl", "reinforcement learning"),
    "dpo_loss_weights": _only("rl", "reinforcement learning"),
    "dpo_norm_loss": _only("rl", "reinforcement learning"),
    "dpo_padding_free": _only("rl", "reinforcement learning"),
    "dpo_use_liger_kernel": _only("rl", "reinforcement learning"),
    "dpo_use_logits_to_keep": _only("rl", "reinforcement learning"),
    "dpo_use_weighting": _only("rl", "reinforcement learning"),
    "dsv4_bf16_all": _only("use_dsv4_kernels", "DeepSeek-V4 MoE kernels"),
    "dsv4_fp4_grouped_mode": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "dsv4_fp8_lora_kernel": _only("use_dsv4_kernels", "DeepSeek-V4 MoE kernels"),
    "dsv4_fp8_nonexpert_mode": _only("use_dsv4_kernels", "DeepSeek-V4 MoE kernels"),
    "dsv4_shared_mlp_lora_kernel": _only("use_dsv4_kernels", "DeepSeek-V4 MoE kernels"),
    "dynamic_checkpoint": _u("checkpoints triggered by a file or signal"),
    "eaft_alpha": _only("use_eaft", "entropy-aware focal loss"),
    "eaft_k": _only("use_eaft", "entropy-aware focal loss"),
    "eager_attention": _i("true means eager", ours="attn_implementation"),
    "early_stopping_patience": _i(),
    "ebft": _u("EBFT training"),
    "embedding_lr": _i("embed_tokens and lm_head in a group of their own, no weight decay"),
    "embedding_lr_scale": _i("embed_tokens and lm_head at learning_rate x this"),
    "embeddings_skip_upcast": _g("only affects PEFT adapters, which shardforge does not train"),
    "eot_tokens": _i(),
    "eval_batch_size": _i(),
    "eval_causal_lm_metrics": _g(_GEN_EVAL),
    "eval_max_new_tokens": _g(_GEN_EVAL),
    "eval_on_start": _g(_EVAL_SCHEDULE),
    "eval_sample_packing": _i(),
    "eval_sequence_len": _i(),
    "eval_steps": _i(),
    "eval_strategy": _g(_EVAL_SCHEDULE),
    "eval_table_size": _g(_GEN_EVAL),
    "evals_per_epoch": _i(),
    "evaluation_strategy": _g(_EVAL_SCHEDULE),
    "excess_length_strategy": _i(
        "null truncates (packed: cuts into pieces), as shardforge did before; Axolotl drops"
    ),
    "experimental_skip_move_to_device": _g("model loading detail; FSDP2 places the shards"),
    "expert_backend": _u(_MOE_PLUGIN),
    "expert_parallel_backend": _only("expert_parallel_size > 1", "expert parallelism"),
    "expert_parallel_dispatch_chunks": _only("expert_parallel_size > 1", "expert parallelism"),
    "expert_parallel_fallback_on_unsupported": _only(
        "expert_parallel_size > 1", "expert parallelism"
    ),
    "expert_parallel_num_nvl_bytes": _only("expert_parallel_size > 1", "expert parallelism"),
    "expert_parallel_num_rdma_bytes": _only("expert_parallel_size > 1", "expert parallelism"),
    "expert_parallel_save_dispatch": _only("expert_parallel_size > 1", "expert parallelism"),
    "expert_parallel_size": _u(_EXPERT_PARALLEL),
    "expert_parallel_token_capacity": _only("expert_parallel_size > 1", "expert parallelism"),
    "experts_implementation": _u("alternative MoE experts implementations"),
    "export": _g("settings of `axolotl export` (GGUF conversion); not part of training"),
    "fa_varlen_kwargs_in_collator": _g(
        "packed batches always get cu_seqlens, once per batch outside the model (speed only)"
    ),
    "fix_untrained_tokens": _i(),
    "flash_attention": _i(
        "true means attn_implementation: flash_attention_2 (packed batches: varlen with "
        "cu_seqlens at any micro_batch_size)",
        ours="attn_implementation",
    ),
    "flash_attn_cross_entropy": _u("flash-attn fused kernels"),
    "flash_attn_d512": _u("large-head attention kernels"),
    "flash_attn_fuse_mlp": _u("flash-attn fused kernels"),
    "flash_attn_rms_norm": _u("flash-attn fused kernels"),
    "flash_optimum": _u("BetterTransformer (optimum)"),
    "flex_attention": _i(
        "true means attn_implementation: flex_attention (packed batches: a BlockMask from the "
        "document ids, docs/train.md; train needs a CUDA GPU for it)",
        ours="attn_implementation",
    ),
    "flex_attn_compile_kwargs": _g("compile settings of flex attention; speed only"),
    "float16": _i(),
    "float32": _g(_FLOAT32),
    "fp16": _i(),
    "fp32_norm_classes": _i(),
    "fp32_norms": _i(),
    "fp8": _i(),
    "fp8_config": _u("FP8 training"),
    "fp8_enable_fsdp_float8_all_gather": _i(),
    "freeze_mm_modules": _u(_MULTIMODAL),
    "fsdp_config": _i(ours="fsdp"),
    "fsdp_final_state_dict_type": _u("separate state dict type for the final save"),
    "fsdp_version": _i(ours="fsdp.fsdp_version"),
    "full_determinism": _i(),
    "fused_attn_kernel": _u("fused RMSNorm+RoPE kernels"),
    "gc_collect_steps": _g(_MEMORY),
    "gc_steps": _g(_MEMORY),
    "gemma4_fp8_nonexpert": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "gemma4_hybrid_attn_impl": _u("Gemma 4 hybrid attention"),
    "gemma4_nf4_nonexpert": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "generate_samples": _g(_SAMPLES),
    "generation_do_sample": _g(_SAMPLES),
    "generation_max_new_tokens": _g(_SAMPLES),
    "generation_prompt_ratio": _g(_SAMPLES),
    "generation_temperature": _g(_SAMPLES),
    "generation_top_k": _g(_SAMPLES),
    "generation_top_p": _g(_SAMPLES),
    "gptq": _u("GPTQ quantized models"),
    "gpu_memory_limit": _g(_MEMORY),
    "gradient_accumulation_steps": _i(),
    "gradient_checkpointing": _i(),
    "gradient_checkpointing_kwargs": _g("shardforge always uses non-reentrant checkpointing"),
    "gradio_max_new_tokens": _i("`inference --gradio`"),
    "gradio_server_name": _i("`inference --gradio`"),
    "gradio_server_port": _i("`inference --gradio`"),
    "gradio_share": _i(
        "`inference --gradio`; off by default (Axolotl: on): no public link unless asked"
    ),
    "gradio_temperature": _i("`inference --gradio`"),
    "gradio_title": _i("`inference --gradio`"),
    "greater_is_better": _i(),
    "grokfast_alpha": _only("the Grokfast plugin", "plugins"),
    "grokfast_lamb": _only("the Grokfast plugin", "plugins"),
    "group_by_length": _g("length-grouped batching is not done; batches follow the shuffled order"),
    "hatchery": _u("Hatchery (plugin)"),
    "heads_k_stride": _only("context_parallel_size > 1", "ring attention"),
    "hf_mlflow_log_artifacts": _g(_TRACKING),
    "hf_use_auth_token": _g("hub credentials come from the environment"),
    "hub_model_id": _g(_HUB),
    "hub_revision": _g(_HUB),
    "hub_strategy": _g(_HUB),
    "image_resize_algorithm": _only("processor_type", "multimodal training"),
    "image_size": _only("processor_type", "multimodal training"),
    "include_tkps": _g("throughput logging only"),
    "include_tokens_per_second": _g("throughput logging only"),
    "is_falcon_derived_model": _g("model family hint; the model class comes from config.json"),
    "is_llama_derived_model": _g("model family hint; the model class comes from config.json"),
    "is_mistral_derived_model": _g("model family hint; the model class comes from config.json"),
    "is_preprocess": _g(_INTERNAL),
    "is_qwen_derived_model": _g("model family hint; the model class comes from config.json"),
    "jagged_restart_anneal_steps": _only("jagged_restart_steps", "jagged LR restarts"),
    "jagged_restart_steps": _u("jagged LR restarts"),
    "jagged_restart_warmup_steps": _only("jagged_restart_steps", "jagged LR restarts"),
    "kd_alpha": _only("the knowledge-distillation plugin", "plugins"),
    "kd_beta": _only("the knowledge-distillation plugin", "plugins"),
    "kd_ce_alpha": _only("the knowledge-distillation plugin", "plugins"),
    "kd_normalize_topk": _only("the knowledge-distillation plugin", "plugins"),
    "kd_online_server": _only("the knowledge-distillation plugin", "plugins"),
    "kd_online_server_base_url": _only("the knowledge-distillation plugin", "plugins"),
    "kd_online_timeout": _only("the knowledge-distillation plugin", "plugins"),
    "kd_online_topk": _only("the knowledge-distillation plugin", "plugins"),
    "kd_temperature": _only("the knowledge-distillation plugin", "plugins"),
    "kd_temperature_min": _only("the knowledge-distillation plugin", "plugins"),
    "kd_trainer": _only("the knowledge-distillation plugin", "plugins"),
    "kto_desirable_weight": _only("rl", "reinforcement learning"),
    "kto_undesirable_weight": _only("rl", "reinforcement learning"),
    "label_balance_window_optim_steps": _only("balance_labels", "supervised-token balancing"),
    "large_head_attention": _u("large-head attention kernels"),
    "layer_offloading": _g(_MEMORY),
    "learning_rate": _i(),
    "liger_cross_entropy": _i(_LIGER_ON),
    "liger_fused_linear_cross_entropy": _i(_LIGER_ON),
    "liger_glu_activation": _i(_LIGER_ON),
    "liger_kernel_impl": _u(_LIGER),
    "liger_layer_norm": _i(_LIGER_ON),
    "liger_rms_norm": _i(_LIGER_ON),
    "liger_rms_norm_gated": _u(_LIGER),
    "liger_rope": _i(_LIGER_ON),
    "liger_swiglu": _i(_LIGER_ON),
    "liger_use_token_scaling": _u(_LIGER),
    "lisa_layers_attribute": _only("lisa_n_layers", "LISA layer sampling"),
    "lisa_n_layers": _u("LISA layer sampling"),
    "lisa_step_interval": _only("lisa_n_layers", "LISA layer sampling"),
    "llama4_linearized_experts": _u("Llama 4 linearized experts"),
    "llmcompressor": _u("LLM Compressor sparsity (plugin)"),
    "lm_eval_batch_size": _i("`shardforge lm-eval`"),
    "lm_eval_model": _i("`shardforge lm-eval`"),
    "lm_eval_post_train": _g("train does not run lm-eval at its end; run `shardforge lm-eval CFG`"),
    "lm_eval_tasks": _i("`shardforge lm-eval`"),
    "load_best_model_at_end": _i(),
    "load_in_4bit": _i("NF4 base weights (torchao's NF4Tensor), sharded by FSDP2"),
    "load_in_8bit": _i("int8 base weights, one scale per row (torchao), sharded by FSDP2"),
    "local_rank": _g(_LAUNCHER),
    "logging_nan_inf_filter": _g("logging only; does not change the trained weights"),
    "logging_steps": _i(),
    "lora_alpha": _i(),
    "lora_alpha_pattern": _i(),
    "lora_dropout": _i(),
    "lora_embedding_kernel": _u("LoRA kernels"),
    "lora_fan_in_fan_out": _i(),
    "lora_fp32_gradients": _u("float32 LoRA gradient accumulation"),
    "lora_mlp_kernel": _u("LoRA kernels"),
    "lora_model_dir": _i(),
    "lora_modules_to_save": _i(),
    "lora_o_kernel": _u("LoRA kernels"),
    "lora_on_cpu": _u(_LORA),
    "lora_qkv_kernel": _u("LoRA kernels"),
    "lora_r": _i(),
    "lora_rank_pattern": _i(),
    "lora_target_linear": _i(),
    "lora_target_modules": _i(),
    "lora_target_parameters": _u(_LORA),
    "loraplus_lr_embedding": _i("LoRA+: the lr of LoRA embedding layers (PEFT's groups)"),
    "loraplus_lr_ratio": _i("LoRA+: lora_B at learning_rate x this (PEFT's groups)"),
    "loss_watchdog_patience": _g("loss watchdog (aborts a diverging run) is not supported"),
    "loss_watchdog_threshold": _g("loss watchdog (aborts a diverging run) is not supported"),
    "low_cpu_mem_usage": _g(_MEMORY),
    "lr_div_factor": _i(
        "one_cycle's div_factor (its first lr is learning_rate / this); Axolotl 0.21 defines the "
        "key but does not read it; with another schedule it is refused"
    ),
    "lr_groups": _i("per-module learning rates (Axolotl's groups)"),
    "lr_quadratic_warmup": _i("cosine with quadratic warmup"),
    "lr_scheduler": _i(
        "transformers' scheduler names and Axolotl's one_cycle, rex; reduce_lr_on_plateau "
        "(stepped by an eval metric) is refused"
    ),
    "lr_scheduler_kwargs": _i("passed to the schedule (transformers' get_scheduler, OneCycleLR)"),
    "max_grad_norm": _i(),
    "max_memory": _g(_MEMORY),
    "max_packed_sequence_len": _u("legacy packing (max_packed_sequence_len)"),
    "max_prompt_len": _only("rl", "reinforcement learning"),
    "max_steps": _i(),
    "mean_resizing_embeddings": _i(),
    "merge_lora": _u("merging LoRA adapters"),
    "merge_method": _u("merging LoRA adapters", default="memory_efficient"),
    "metric_for_best_model": _i(),
    "micro_batch_size": _i(),
    "min_sample_len": _i(),
    "mixlora_expert_lora_alpha": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_expert_lora_dropout": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_expert_lora_r": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_jitter_noise": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_num_experts": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_router_aux_loss_coef": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_router_init_range": _only("adapter: mixlora", "MixLoRA adapters"),
    "mixlora_top_k": _only("adapter: mixlora", "MixLoRA adapters"),
    "mlflow_experiment_name": _g(_TRACKING),
    "mlflow_run_name": _g(_TRACKING),
    "mlflow_tracking_uri": _g(_TRACKING),
    "model_config": _i(ours="model_config_overrides"),
    "model_kwargs": _i(),
    "model_quantization_config": _u("quantized model loading (MXFP4/FP8)"),
    "model_quantization_config_kwargs": _only(
        "model_quantization_config", "quantized model loading"
    ),
    "model_revision": _u("loading a specific model revision"),
    "model_type": _i("read from config.json; AutoModelForCausalLM"),
    "moe_bnb_fast": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "moe_dequant_chunk_size": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "moe_grouped_backend": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "mora": _u("MoRA adapters (plugin)"),
    "multipack_real_batches": _u(_MULTIPACK),
    "neftune_noise_alpha": _i(),
    "nemo_gym_auto_clone": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_auto_start": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_config_paths": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_datasets": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_dir": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_enabled": _u(_NEMO, default=False),
    "nemo_gym_head_port": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_max_turns": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_model_name": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_multi_turn": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_run_timeout": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_server_timeout": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nemo_gym_verify_timeout": _only("nemo_gym_enabled", "NeMo Gym environments"),
    "nf4_backend": _u("NF4 backends of QLoRA"),
    "noisy_embedding_alpha": _u("NEFTune embedding noise"),
    "nonexpert_quantization": _only("use_scattermoe", "ScatterMoE expert kernels"),
    "num_dataset_shards_to_save": _g(_PREPROCESS),
    "num_epochs": _i(),
    "num_generation_samples": _g(_SAMPLES),
    "num_labels": _only("reward_model / process_reward_model", "reward model training"),
    "nvfp4_merge_aware": _only("use_sonicmoe", "SonicMoE expert kernels"),
    "nvfp4_merge_aware_start_step": _only("use_sonicmoe", "SonicMoE expert kernels"),
    "optim_args": _i("keyword arguments of the optimizer (a mapping or 'k=v,k=v')"),
    "optim_target_modules": _u("optimizer extra arguments"),
    "optimizer": _i(),
    "orpo_alpha": _only("rl", "reinforcement learning"),
    "otel_metrics_host": _g(_TRACKING),
    "otel_metrics_port": _g(_TRACKING),
    "output_dir": _i(),
    "overrides_of_model_config": _i(ours="model_config_overrides"),
    "overrides_of_model_kwargs": _i(ours="model_kwargs"),
    "pad_to_multiple_of": _g("padding only; padded positions carry no loss"),
    "pad_to_sequence_len": _g("padding only; padded positions carry no loss"),
    "peft": _u(_LORA),
    "peft_autocast_adapter_dtype": _u(_LORA),
    "peft_ensure_weight_tying": _u(_LORA),
    "peft_init_lora_weights": _u(_LORA),
    "peft_layer_replication": _u(_LORA),
    "peft_layers_pattern": _i(),
    "peft_layers_to_transform": _i(),
    "peft_trainable_token_indices": _u(_LORA),
    "peft_use_dora": _i("DoRA adapters", refused=(True,)),
    "peft_use_rslora": _i(),
    "ple_cpu_offload": _g(_MEMORY),
    "plugins": _i(
        "LigerPlugin, CutCrossEntropyPlugin, KernelsPlugin (their kernels on CUDA with their "
        "package, else the same math and one notice); any other plugin is refused"
    ),
    "pose_max_context_len": _only("use_pose", "PoSE context extension"),
    "pose_num_chunks": _only("use_pose", "PoSE context extension"),
    "pose_split_on_token_ids": _only("use_pose", "PoSE context extension"),
    "precompute_ref_log_probs": _only("rl", "reinforcement learning"),
    "preprocess_iterable": _g(_PREPROCESS),
    "pretrain_multipack_attn": _only("streaming / pretraining_dataset", "streamed data sets"),
    "pretrain_multipack_buffer_size": _only(
        "streaming / pretraining_dataset", "streamed data sets"
    ),
    "pretraining_dataset": _u("streaming pretraining datasets"),
    "pretraining_sample_concatenation": _only(
        "streaming / pretraining_dataset", "streamed data sets"
    ),
    "process_reward_model": _u(_REWARD),
    "processor_kwargs": _only("processor_type", "multimodal training"),
    "processor_type": _u(_MULTIMODAL),
    "profiler_steps": _g("profiling only"),
    "profiler_steps_start": _g("profiling only"),
    "push_dataset_to_hub": _g(_HUB),
    "qat": _i(),
    "qgalore_cos_threshold": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_gamma_proj": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_proj_bits": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_proj_group_size": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_proj_quant": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_proj_type": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_queue_size": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_rank": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_scale": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qgalore_update_proj_gap": _only("optimizer: q_galore_adamw8bit", "Q-GaLore optimizer"),
    "qlora_sharded_model_loading": _g(
        "QLoRA loading is always sharded: each rank keeps only its slice of the 4-bit weights"
    ),
    "quantization": _i(
        "`shardforge quantize` (weight_dtype int8|int4, activation_dtype int8, group_size, "
        "quantize_embedding); fp8/nvfp4/mxfp4 are not offered"
    ),
    "quantize_moe_experts": _u("quantized MoE experts"),
    "ray_num_workers": _g("Ray launching is not supported; launch with shardforge train"),
    "ray_run_name": _g("Ray launching is not supported; launch with shardforge train"),
    "reinit_weights": _u("random re-initialisation of the weights"),
    "relora": _u("ReLoRA"),
    "relora_cpu_offload": _only("relora", "ReLoRA"),
    "relora_prune_method": _only("relora", "ReLoRA"),
    "relora_prune_ratio": _only("relora", "ReLoRA"),
    "remove_unused_columns": _g("only the configured fields of each row are read"),
    "resize_token_embeddings_to_32x": _i(),
    "resources_per_worker": _g("Ray launching is not supported; launch with shardforge train"),
    "resume_from_checkpoint": _i(),
    "revision_of_model": _u("loading a specific model revision"),
    "reward_model": _u(_REWARD),
    "ring_attn_func": _only("context_parallel_size > 1", "ring attention"),
    "rl": _u(_RL),
    "rl_beta": _only("rl", "reinforcement learning"),
    "role_boundaries": _u(_MULTIMODAL),
    "rope_scaling": _u("RoPE scaling (Axolotl now expects it under model_config)"),
    "rpo_alpha": _only("rl", "reinforcement learning"),
    "s2_attention": _u("shifted sparse attention"),
    "sage_attention": _u("SageAttention"),
    "sample_packing": _i(
        "packed batches reach the attention without a dense mask where it can run: a flex "
        "BlockMask, varlen cu_seqlens (flash_attention_2, varlen_attention; sdpa switches to "
        "one on a GPU); docs/train.md"
    ),
    "sample_packing_bin_size": _u(_MULTIPACK),
    "sample_packing_eff_est": _g("step-count estimate; shardforge counts the packed sequences"),
    "sample_packing_group_size": _u(_MULTIPACK),
    "sample_packing_mp_start_method": _g("multiprocessing start method of the packer; speed only"),
    "sample_packing_sequentially": _u(_MULTIPACK),
    "save_first_step": _i(),
    "save_only_model": _i(),
    "save_safetensors": _g("shardforge always saves safetensors"),
    "save_steps": _i(),
    # `no` saves nothing, not even the final model (which Axolotl still saves)
    "save_strategy": _i(
        "keeping the checkpoint with the best eval metric (save_strategy: best)",
        refused=("best",),
    ),
    "save_total_limit": _i(),
    "saves_per_epoch": _i(),
    "scaling_softmax": _u("scalable softmax attention (SSMax)"),
    "scaling_softmax_bias": _only("scaling_softmax", "scalable softmax attention"),
    "scaling_softmax_factor": _only("scaling_softmax", "scalable softmax attention"),
    "sdp_attention": _i("true means sdpa", ours="attn_implementation"),
    "sdpa_varlen": _g(_SPEED),
    "seed": _i(),
    "selective_checkpointing": _g("checkpointing granularity; memory/speed only"),
    "sequence_len": _i(),
    "sequence_parallel_degree": _u("sequence parallelism", default=1),
    "shrink_embeddings": _i(),
    "shuffle_before_merging_datasets": _i(),
    "shuffle_merged_datasets": _i(),
    "simpo_gamma": _only("rl", "reinforcement learning"),
    "skip_prepare_dataset": _g(_PREPROCESS),
    "special_tokens": _i(),
    "spectrum_model_name": _only("the Spectrum plugin", "plugins"),
    "spectrum_top_fraction": _only("the Spectrum plugin", "plugins"),
    "streaming": _u("streaming datasets"),
    "streaming_multipack_buffer_size": _only(
        "streaming / pretraining_dataset", "streamed data sets"
    ),
    "strict": _g("Axolotl's own config check; shardforge always checks keys"),
    "swanlab_api_host": _g(_TRACKING),
    "swanlab_api_key": _g(_TRACKING),
    "swanlab_completion_log_interval": _g(_TRACKING),
    "swanlab_completion_max_buffer": _g(_TRACKING),
    "swanlab_description": _g(_TRACKING),
    "swanlab_experiment_name": _g(_TRACKING),
    "swanlab_lark_secret": _g(_TRACKING),
    "swanlab_lark_webhook_url": _g(_TRACKING),
    "swanlab_log_completions": _g(_TRACKING),
    "swanlab_log_model": _g(_TRACKING),
    "swanlab_mode": _g(_TRACKING),
    "swanlab_project": _g(_TRACKING),
    "swanlab_web_host": _g(_TRACKING),
    "swanlab_workspace": _g(_TRACKING),
    "sync_profiler_start_step": _g("profiling only"),
    "sync_profiler_steps": _g("profiling only"),
    "tensor_parallel_size": _u("tensor parallelism", default=1),
    "test_datasets": _i(),
    "tf32": _i(),
    "tiled_mlp": _u("tiled MLP (ALST)"),
    "tiled_mlp_num_shards": _only("tiled_mlp", "tiled MLP"),
    "tiled_mlp_use_original_mlp": _only("tiled_mlp", "tiled MLP"),
    "tokenizer_config": _i(),
    "tokenizer_legacy": _i(),
    "tokenizer_save_jinja_files": _g("tokenizer file layout only"),
    "tokenizer_type": _i("AutoTokenizer-compatible names are loaded with AutoTokenizer"),
    "tokenizer_use_fast": _i(),
    "tokenizer_use_mistral_common": _u("mistral-common tokenizers"),
    "tokens": _i(),
    "torch_compile": _i("each transformer block compiled in place"),
    "torch_compile_backend": _i(),
    "torch_compile_mode": _i(),
    "torch_compile_options": _i(),
    "torch_compile_regional": _g("shardforge always compiles block by block (regionally)"),
    "torch_empty_cache_steps": _g(_MEMORY),
    "torchdistx_path": _g("only used by the adamw_anyprecision optimizer, which is unsupported"),
    "total_num_tokens": _g(_INTERNAL),
    "total_supervised_tokens": _g(_INTERNAL),
    "trackio_project_name": _g(_TRACKING),
    "trackio_run_name": _g(_TRACKING),
    "trackio_space_id": _g(_TRACKING),
    "train_on_inputs": _i(),
    "trainer_cls": _u("custom trainer classes"),
    "trl": _only("rl", "reinforcement learning"),
    "trust_remote_code": _i(),
    "type_of_model": _g("field name behind model_type; the model class comes from config.json"),
    "unfrozen_parameters": _i(),
    "use_comet": _g(_TRACKING),
    "use_dft": _u("Dynamic Fine-Tuning loss (DFT)"),
    "use_dsv4_kernels": _u(_MOE_PLUGIN),
    "use_eaft": _u("entropy-aware focal training loss (EAFT)"),
    "use_glm_dsa_kernels": _u(_MOE_PLUGIN),
    "use_kernels": _i(
        "transformers' set_use_kernels on CUDA with the kernels package, else the model's own "
        "modules (one notice)"
    ),
    "use_mlflow": _g(_TRACKING),
    "use_onebitllms": _u("1.58-bit (BitNet) training"),
    "use_otel_metrics": _g(_TRACKING),
    "use_pose": _u("PoSE context extension"),
    "use_ray": _g("Ray launching is not supported; launch with shardforge train"),
    "use_scattermoe": _u(_MOE_PLUGIN),
    "use_sonicmoe": _u(_MOE_PLUGIN),
    "use_swanlab": _g(_TRACKING, default=False),
    "use_tensorboard": _i(),
    "use_trackio": _g(_TRACKING),
    "use_wandb": _g("Axolotl derives it: W&B is on when wandb_project is set"),
    "val_set_size": _i(),
    "vllm": _only("rl", "reinforcement learning"),
    "wandb_entity": _i(),
    "wandb_log_model": _g(_WANDB_EXTRAS),
    "wandb_mode": _i(),
    "wandb_name": _i(),
    "wandb_project": _i(),
    "wandb_run_id": _i(),
    "wandb_watch": _g(_WANDB_EXTRAS),
    "warmup_ratio": _i("rounded down, as Axolotl"),
    "warmup_steps": _i(
        "a number below 1 is a fraction of the steps (transformers' reading; Axolotl 0.21's "
        "schema refuses it); no warmup key: 3% of the steps up to 100, as Axolotl"
    ),
    "weight_decay": _i(),
    "world_size": _g(_LAUNCHER),
    "xformers_attention": _u("xformers attention"),
}

# Keys of one `datasets:` entry.
DATASET_STATUS: dict[str, AxolotlKey] = {
    "chat_template": _i(),
    "chat_template_jinja": _i(),
    "conversation": _u("FastChat conversation templates"),
    "data_files": _i("files of the local folder `path`; Hub data sets are not downloaded"),
    "drop_system_message": _i(),
    "ds_type": _i(),
    "field": _i(),
    "field_chosen": _g(_ONLY_TYPES),
    "field_human": _u("legacy conversation field names"),
    "field_messages": _i(),
    "field_model": _u("legacy conversation field names"),
    "field_rejected": _g(_ONLY_TYPES),
    "field_thinking": _i(),
    "field_tools": _i(),
    "input_format": _u("custom prompt input formats"),
    "input_transform": _u("row transform functions"),
    "logprobs_field": _g(_ONLY_TYPES),
    "max_completion_length": _g(_ONLY_TYPES),
    "message_field_content": _i(
        "older spelling of message_property_mappings.content", ours="message_property_mappings"
    ),
    "message_field_role": _i(
        "older spelling of message_property_mappings.role", ours="message_property_mappings"
    ),
    "message_field_training": _i(),
    "message_field_training_detail": _i(),
    "message_property_mappings": _i(),
    "name": _i("a configuration of a local data set folder (README.md `configs:`)"),
    "path": _i(),
    "preprocess_shards": _g(_PREPROCESS),
    "revision": _i("a local path has no revisions (Axolotl ignores it there too)"),
    "roles": _i(),
    "roles_to_train": _i(),
    "shards": _i(),
    "shards_idx": _i(),
    "split": _i(),
    "split_thinking": _i(),
    "step_separator": _g(_ONLY_TYPES),
    "temperature": _g(_ONLY_TYPES),
    "template_thinking_key": _i(),
    "train_on_eos": _i(),
    "train_on_eot": _i(),
    "train_on_last_step_only": _g(_ONLY_TYPES),
    "trust_remote_code": _g("dataset loading scripts are never run; data are local files"),
    "type": _i("completion, chat_template, alpaca and input_output"),
    "weight": _i("rows taken round(weight x rows) times"),
}

# Keys of `fsdp_config`, without the `fsdp_` prefix.
FSDP_CONFIG_STATUS: dict[str, AxolotlKey] = {
    "activation_checkpointing": _i(),
    "auto_wrap_policy": _g(_FSDP2_MOOT_WRAP),
    "cpu_offload_pin_memory": _g(_SPEED),
    "cpu_ram_efficient_loading": _g(_MEMORY),
    "final_state_dict_type": _u("separate state dict type for the final save"),
    "fsdp_version": _i("2 only (FSDP2)"),
    "min_num_params": _g(_FSDP2_MOOT_WRAP),
    "mixed_precision_policy": _u("mixed-precision policy strings (use fsdp.mixed_precision)"),
    "offload_params": _i(),
    "reshard_after_forward": _i(),
    "state_dict_type": _i("SHARDED_STATE_DICT or FULL_STATE_DICT"),
    "transformer_layer_cls_to_wrap": _i(),
    "version": _i("2 only (FSDP2)", ours="fsdp_version"),
}

# Top-level keys of Axolotl's own example configs that Axolotl 0.21 does not define.
LEGACY_TOP_LEVEL: dict[str, AxolotlKey] = {
    "adam_eps": _g(f"{_DROPPED}: AdamW's epsilon is adam_epsilon"),
    "base_model_ignore_patterns": _g(f"{_DROPPED}; nothing is downloaded"),
    "debug": _g(f"{_DROPPED} (its --debug flag is not a config key); shardforge has --debug"),
    "eta_min": _g(f"{_DROPPED}: the schedule's floor is cosine_min_lr_ratio"),
    "fsdp": _i(
        "the list form (full_shard, shard_grad_op, offload, auto_wrap) is read as the fsdp "
        "block (Axolotl 0.21 refuses the list)"
    ),
    "full_finetune": _g(f"{_DROPPED}; a run without `adapter` is a full fine-tune"),
    "gptq_disable_exllama": _g(f"{_DROPPED} (older GPTQ settings)"),
    "gptq_groupsize": _g(f"{_DROPPED} (older GPTQ settings)"),
    "gptq_model_v1": _g(f"{_DROPPED} (older GPTQ settings)"),
    "sample_packing_seq_len_multiplier": _g(f"{_DROPPED} (an older packing option)"),
    "torch_dtype": _g(f"{_DROPPED}: the dtype follows bf16 / fp16"),
}

# FSDP1 keys of `fsdp_config` that Axolotl's older examples and docs show.
LEGACY_FSDP_CONFIG: dict[str, AxolotlKey] = {
    "backward_prefetch": _g(_FSDP1),
    "backward_prefetch_policy": _g(_FSDP1),
    "cpu_offload": _i("older spelling of offload_params", ours="offload_params"),
    "forward_prefetch": _g("FSDP1 only (Axolotl 0.21 refuses it); no meaning under FSDP2"),
    "limit_all_gathers": _g(_FSDP1),
    "sharding_strategy": _i(
        "FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, HYBRID_SHARD_ZERO2 are mapped to FSDP2 "
        "settings (Axolotl 0.21 refuses it: FSDP1 only)"
    ),
    "sync_module_states": _g(_FSDP1),
    "use_orig_params": _g(_FSDP1),
}

BOOLEAN_FLAGS: frozenset[str] = frozenset({"bool | None", "Optional[bool]"})


def placeholder(field: AxolotlField) -> Any:
    """The value of a key that changes nothing besides null: Axolotl's default; false for an
    on/off flag whose default is null (off)."""
    if field.default is None and field.annotation in BOOLEAN_FLAGS:
        return False
    return field.default


def _rows(
    fields: Mapping[str, AxolotlField],
    status: Mapping[str, AxolotlKey],
    legacy: Mapping[str, AxolotlKey],
) -> dict[str, AxolotlKey]:
    """The decisions with their placeholders filled in from Axolotl's defaults; the legacy keys
    after them (a legacy row's placeholder is null only)."""
    out = {}
    for key, row in status.items():
        if row.default is SCHEMA:
            field = fields.get(key, AxolotlField(None, ""))
            row = row._replace(default=placeholder(field))
        out[key] = row
    for key, row in legacy.items():
        out[key] = row._replace(default=None) if row.default is SCHEMA else row
    return out


TOP_LEVEL = _rows(TOP_LEVEL_FIELDS, TOP_LEVEL_STATUS, LEGACY_TOP_LEVEL)
DATASET_KEYS = _rows(DATASET_FIELDS, DATASET_STATUS, {})
FSDP_CONFIG_KEYS = _rows(FSDP_CONFIG_FIELDS, FSDP_CONFIG_STATUS, LEGACY_FSDP_CONFIG)
