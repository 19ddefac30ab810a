"""The optimizer and learning-rate schedule keys."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardforge.config.view import ConfigView

# transformers' SchedulerType names (reduce_lr_on_plateau: stepped on each evaluation's metric)
# and Axolotl's own one_cycle and rex
Scheduler = Literal[
    "cosine",
    "linear",
    "constant",
    "constant_with_warmup",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "reduce_lr_on_plateau",
    "one_cycle",
    "rex",
]
Optimizer = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "sgd",
    "adamw_torch_8bit",
    "adamw_torch_4bit",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "muon",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "apollo_adamw",
    "apollo_adamw_layerwise",
]
# the optimizers of low-rank projected gradients (GaLore, APOLLO): they read optim_target_modules
PROJECTED = tuple(n for n in get_args(Optimizer) if n.startswith(("galore_", "apollo_")))


class LrGroup(BaseModel):
    """One `lr_groups` entry: the parameters of modules whose name contains one of `modules`
    train at `lr`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="A name for the group.")
    modules: list[str] = Field(min_length=1, description="Substrings of parameter names.")
    lr: float = Field(gt=0, description="The group's peak learning rate.")


class OptimKeys(ConfigView):
    """Optimizer and schedule."""

    # -- optimization ----------------------------------------------------------------------------
    learning_rate: float = Field(2e-5, gt=0)
    """Peak learning rate."""
    lr_scheduler: Scheduler = "cosine"
    """Schedule after warmup: transformers' scheduler names, Axolotl's one_cycle, rex."""
    lr_scheduler_kwargs: dict[str, Any] | None = None
    """Keyword arguments of the schedule (e.g. num_cycles, min_lr_rate)."""
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1)
    """cosine/rex: decay to this fraction of the peak lr."""
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1)
    """cosine with cosine_min_lr_ratio: reach the floor at this fraction of steps."""
    lr_quadratic_warmup: bool | None = None
    """cosine: quadratic instead of linear warmup."""
    lr_div_factor: float | None = Field(None, gt=0)
    """one_cycle: the first lr is learning_rate / lr_div_factor."""
    warmup_steps: int | float | None = Field(None, ge=0)
    """Warmup length in optimizer steps (a number below 1: a fraction of all steps)."""
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """Warmup length as a fraction of all steps."""
    optimizer: Optimizer = "adamw_torch"
    """adamw_torch(_fused), sgd, torchao 8/4-bit AdamW, bitsandbytes 8-bit AdamW, muon."""
    optim_args: dict[str, Any] | str | None = None
    """Extra optimizer arguments: a mapping or 'key=value,key=value'."""
    optim_target_modules: list[str] | str | None = None
    """GaLore/APOLLO: the linear layers whose gradients are projected (names, substrings or a regex;
    all_linear)."""
    lr_groups: list[LrGroup] | None = None
    """Per-module learning rates: [{name, modules, lr}]."""
    embedding_lr: float | None = Field(None, gt=0)
    """The learning rate of embed_tokens and lm_head."""
    embedding_lr_scale: float | None = Field(None, gt=0)
    """embed_tokens and lm_head train at learning_rate x this."""
    loraplus_lr_ratio: float | None = Field(None, gt=0)
    """LoRA+: lora_B trains at learning_rate x this."""
    loraplus_lr_embedding: float | None = Field(1e-6, gt=0)
    """LoRA+: the learning rate of LoRA embedding layers."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global L2 norm over all shards (null or 0: no clip)."""

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_whole_or_fraction(cls, value: int | float | None) -> int | float | None:
        """A whole number of steps, or (as transformers reads it) a fraction below 1."""
        if isinstance(value, float) and value >= 1:
            if not value.is_integer():
                raise ValueError("a whole number of steps, or a fraction of all steps below 1")
            return int(value)
        return value

    @model_validator(mode="after")
    def _schedule_extras(self) -> OptimKeys:
        """A schedule extra that the chosen schedule does not read is an error, not a no-op."""
        name = self.lr_scheduler
        for key, readers in (
            ("cosine_min_lr_ratio", ("cosine", "rex")),
            ("cosine_constant_lr_ratio", ("cosine",)),
            ("lr_quadratic_warmup", ("cosine",)),
            ("lr_div_factor", ("one_cycle",)),
        ):
            if getattr(self, key) and name not in readers:
                raise ValueError(
                    f"{key}: not supported with lr_scheduler {name} (read by "
                    f"{' or '.join(readers)} only); remove it or change lr_scheduler"
                )
        if self.cosine_constant_lr_ratio is not None and not self.cosine_min_lr_ratio:
            raise ValueError("cosine_constant_lr_ratio: needs cosine_min_lr_ratio (the floor)")
        if self.lr_quadratic_warmup and self.cosine_min_lr_ratio:
            raise ValueError("lr_quadratic_warmup: has no floor; remove cosine_min_lr_ratio")
        if self.embedding_lr is not None and self.embedding_lr_scale is not None:
            raise ValueError("embedding_lr and embedding_lr_scale are both set; choose one")
        self._projection()
        return self

    def _projection(self) -> None:
        """optim_target_modules is read by GaLore/APOLLO only, which need it; their groups are
        transformers' (target / other), so other grouping keys and weight_decay do nothing."""
        if self.optimizer not in PROJECTED:
            if self.optim_target_modules is not None:
                raise ValueError(
                    "optim_target_modules: read only by the galore_* and apollo_* optimizers; "
                    "remove it or change optimizer"
                )
            return
        if not self.optim_target_modules:
            raise ValueError(
                f"optim_target_modules: {self.optimizer} needs the linear layers to project "
                "(e.g. [attn, mlp] or all_linear)"
            )
        for key in ("lr_groups", "embedding_lr", "embedding_lr_scale", "loraplus_lr_ratio"):
            if getattr(self, key) is not None:
                raise ValueError(
                    f"{key}: not applied with optimizer {self.optimizer} (its parameter groups "
                    "are GaLore's target/other split, as in transformers); remove it"
                )
        if self.weight_decay:
            raise ValueError(
                f"weight_decay: not applied with optimizer {self.optimizer} (transformers gives "
                "its groups the optimizer's own default); remove it or set it to 0"
            )
