"""The one schema for a shardforge YAML config. Every field carries a description.

The schema is strict: an unknown key is an error (with a did-you-mean suggestion, see
``config.errors``), never a silently ignored value. A validated config is read-only and reads
like Axolotl's ``DictDefault`` as well (``cfg.fsdp.offload_params``, ``cfg["base_model"]``,
``cfg.get("key")``): see ``config.view``.

Its keys are grouped by stage, one mixin each (fields keep this order in dumps and the JSON
schema): `schema_model` (model, tokenizer, output), `schema_data` (data sets, batch shape),
`schema_optim` (optimizer, schedule), `schema_train` (precision, speed, saves, evaluation,
tracking), `schema_lora` (adapters), `schema_fsdp` (sharding), `schema_use` (using the trained model:
`inference --gradio`, `lm-eval`). A new key goes into its stage's
mixin, its description the docstring under it (`config.view`); checks across stages stay here.
"""

from __future__ import annotations

from pydantic import ValidationInfo, field_validator, model_validator

from shardforge.config.paths import local_path, names_object_storage
from shardforge.config.schema_data import (
    DataKeys,
    DatasetConfig,
    DatasetType,
    StreamKeys,
    stream_conflicts,
)
from shardforge.config.schema_fsdp import DType, FsdpConfig, MixedPrecisionConfig, ShardingKeys
from shardforge.config.schema_lora import LoraKeys, QuantKeys
from shardforge.config.schema_model import STORAGE_SECRET_KEYS, ModelKeys
from shardforge.config.schema_optim import OptimKeys
from shardforge.config.schema_train import (
    CheckpointKeys,
    EvalKeys,
    PrecisionKeys,
    SaveExtrasKeys,
    TrainingOptionKeys,
)
from shardforge.config.schema_use import UseKeys

__all__ = [
    "STORAGE_SECRET_KEYS",
    "DType",
    "DatasetConfig",
    "DatasetType",
    "FsdpConfig",
    "MixedPrecisionConfig",
    "ShardforgeConfig",
    "local_path",
    "names_object_storage",
]


# pydantic orders inherited fields by the reversed MRO: the last base's fields come first
class ShardforgeConfig(
    UseKeys,
    TrainingOptionKeys,
    SaveExtrasKeys,
    EvalKeys,
    ShardingKeys,
    QuantKeys,
    LoraKeys,
    CheckpointKeys,
    PrecisionKeys,
    OptimKeys,
    StreamKeys,
    DataKeys,
    ModelKeys,
):
    """A shardforge config: one YAML file drives `train`, `merge-sharded-fsdp-weights` and more."""

    @field_validator(
        "base_model", "base_model_config", "tokenizer_config", "dataset_prepared_path",
        "lora_model_dir",
    )  # fmt: skip
    @classmethod
    def _local_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        """These keys are read (or written) as local paths (the model's: or hub ids)."""
        hub = info.field_name in ("base_model", "base_model_config", "tokenizer_config")
        return local_path(value, "a local path or hub id" if hub else "a local path")

    @model_validator(mode="after")
    def _consistent(self) -> ShardforgeConfig:
        """Keys that exclude each other; the first conflict found is the error."""
        if self.val_set_size and self.test_datasets:
            raise ValueError("val_set_size and test_datasets are both set; evaluate on one of them")
        for first, second, conflict in (
            ("eval_steps", "evals_per_epoch", self.eval_steps is not None and self.evals_per_epoch),
            ("bf16", "fp16", self.bf16 is True and self.fp16),
            ("bfloat16", "float16", self.bfloat16 and self.float16),
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
        self._needs_evaluation()
        streamed = stream_conflicts(self)
        if streamed:
            raise ValueError(streamed)
        return self

    def _needs_evaluation(self) -> None:
        """The keys that pick or stop on an evaluation need evaluation data."""
        for key in ("load_best_model_at_end", "early_stopping_patience"):
            if getattr(self, key) and not (self.val_set_size or self.test_datasets):
                raise ValueError(f"{key} needs evaluation data; set val_set_size or test_datasets")
        if self.lr_scheduler == "reduce_lr_on_plateau" and not (
            self.val_set_size or self.test_datasets
        ):
            raise ValueError(
                "lr_scheduler: reduce_lr_on_plateau steps on each evaluation's metric; set "
                "val_set_size or test_datasets"
            )

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
