"""The LoRA adapter keys and the quantized base weights of QLoRA / 8-bit LoRA."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from shardforge.config.view import ConfigView


class LoraKeys(ConfigView):
    """LoRA adapters."""

    # -- LoRA adapters ---------------------------------------------------------------------------
    adapter: Literal["lora", "qlora"] | None = None
    """`lora`: train a LoRA adapter on the frozen base model (peft), sharded with FSDP2 like the
    model; checkpoints hold only the adapter and its optimizer state. `qlora`: the same over 4-bit
    (NF4) base weights (with `load_in_4bit: true`, as Axolotl requires); the quantized weights are
    sharded by FSDP2."""
    lora_r: int = Field(8, gt=0)
    """LoRA rank r (the inner dimension of B @ A)."""
    lora_alpha: int = Field(16, gt=0)
    """LoRA alpha: the update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input during training."""
    lora_target_modules: list[str] | str | None = None
    """Module names (or name suffixes, as peft matches them) that get a LoRA adapter, e.g. [q_proj,
    v_proj]; a string is a regular expression peft matches against the whole module name."""
    lora_target_parameters: list[str] | str | None = None
    """Parameters (names or name suffixes) that get a LoRA in place (peft's target_parameters),
    e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] for fused mixture-of-experts experts."""
    lora_target_linear: bool = False
    """Adapt every linear layer except the output layer (peft's `all-linear`), plus
    lora_target_modules."""
    lora_modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter, e.g. [embed_tokens, lm_head] after adding
    tokens; tied embeddings stay tied."""
    lora_fan_in_fan_out: bool = False
    """peft's fan_in_fan_out: the adapted layers store their weight as (in, out), as GPT-2's Conv1D
    does; written to adapter_config.json."""
    lora_rank_pattern: dict[str, int] | None = None
    """peft's rank_pattern: a rank per module name pattern (a regular expression matched against the
    end of the module's name), e.g. {q_proj: 16}."""
    lora_alpha_pattern: dict[str, int] | None = None
    """peft's alpha_pattern: a lora_alpha per module name pattern, as lora_rank_pattern."""
    peft_layers_to_transform: list[int] | None = None
    """peft's layers_to_transform: adapt only the transformer blocks of these indices."""
    peft_layers_pattern: list[str] | None = None
    """peft's layers_pattern: the name of the module list that peft_layers_to_transform indexes
    (e.g. [layers]); peft finds it when unset."""
    peft_use_rslora: bool = False
    """Rank-stabilised LoRA: scale by lora_alpha / sqrt(lora_r)."""
    peft_use_dora: bool = False
    """DoRA adapters: not supported by train (must be false or unset)."""
    lora_model_dir: str | None = None
    """A PEFT adapter directory to start training from (train) or to fuse (merge-lora)."""

    @model_validator(mode="after")
    def _parameter_targets(self) -> LoraKeys:
        """peft's LoRA on a parameter (ParamWrapper) has no dropout and no fan_in_fan_out."""
        for key in ("lora_dropout", "lora_fan_in_fan_out"):
            if self.lora_target_parameters and getattr(self, key):
                raise ValueError(
                    f"lora_target_parameters: peft's LoRA on parameters (ParamWrapper) cannot "
                    f"apply {key}; set {key}: {0.0 if key == 'lora_dropout' else False}"
                )
        return self


class QuantKeys(ConfigView):
    """Quantized base weights under a LoRA adapter (QLoRA, 8-bit LoRA)."""

    # -- quantized base weights ------------------------------------------------------------------
    load_in_4bit: bool = False
    """The frozen base weights of the adapted linear layers in 4 bits (NF4, torchao's NF4Tensor:
    about half a byte per parameter plus block scales), sharded by FSDP2; needs `adapter: qlora` and
    the `quant` extra."""
    load_in_8bit: bool = False
    """The frozen base weights of the adapted linear layers in 8 bits (int8 with one scale per row,
    torchao), sharded by FSDP2; needs `adapter: lora` and the `quant` extra."""
    bnb_config_kwargs: dict[str, Any] | None = None
    """Axolotl's bitsandbytes settings, read as the quantization of load_in_4bit / load_in_8bit:
    bnb_4bit_quant_type (nf4), bnb_4bit_use_double_quant (true: the block scales are quantized too),
    bnb_4bit_compute_dtype (the dtype the dequantized weight is multiplied in: the run's compute
    dtype), bnb_4bit_quant_storage (accepted: the packed data is stored as uint8),
    llm_int8_skip_modules (module names left unquantized)."""

    @model_validator(mode="after")
    def _quantization(self) -> QuantKeys:
        """Axolotl's rules: qlora needs load_in_4bit; 8-bit is for lora; not both."""
        adapter = getattr(self, "adapter", None)
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both set; choose one")
        if adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (4-bit base weights)")
        if self.load_in_4bit and adapter != "qlora":
            raise ValueError(
                "load_in_4bit trains a LoRA adapter over 4-bit base weights: set adapter: qlora"
            )
        if self.load_in_8bit and adapter != "lora":
            raise ValueError(
                "load_in_8bit trains a LoRA adapter over 8-bit base weights: set adapter: lora"
            )
        if self.bnb_config_kwargs and not (self.load_in_4bit or self.load_in_8bit):
            raise ValueError("bnb_config_kwargs is set but neither load_in_4bit nor load_in_8bit")
        for key, value in (self.bnb_config_kwargs or {}).items():
            problem = bnb_problem(key, value, self.load_in_4bit)
            if problem:
                raise ValueError(f"bnb_config_kwargs.{key}: {problem}")
        return self


DTYPE_NAMES = ("bfloat16", "float16", "float32")
# what a value of each bitsandbytes setting must be (None: any value, without effect here)
_BNB_FIXED: dict[str, tuple[Any, str]] = {
    "bnb_4bit_quant_type": ("nf4", "torchao's 4-bit weights are NF4 (fp4 is not implemented)"),
    "bnb_4bit_use_double_quant": (
        True,
        "the NF4 weights always quantize their block scales too (double quantization)",
    ),
    "llm_int8_has_fp16_weight": (False, "the 8-bit base weights are frozen (not trained)"),
}
BNB_KEYS = (
    *_BNB_FIXED,
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
    "llm_int8_skip_modules",
    "load_in_4bit",
    "load_in_8bit",
)


def bnb_dtype(value: Any) -> str | None:
    """A dtype as bitsandbytes settings spell it (`bfloat16`, `torch.bfloat16`, `bf16`), by
    name; None when it is none of bfloat16, float16, float32."""
    name = str(value).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}.get(
        name, name
    )
    return name if name in DTYPE_NAMES else None


def bnb_problem(key: str, value: Any, four_bit: bool) -> str | None:
    """What is wrong with one `bnb_config_kwargs` entry (None: nothing)."""
    if key in _BNB_FIXED:
        want, why = _BNB_FIXED[key]
        return None if value is None or value == want else f"{value!r}: {why}; set {want!r}"
    if key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        ok = value is None or bnb_dtype(value) is not None or str(value).endswith("int8")
        return None if ok else f"{value!r}: expected one of {', '.join(DTYPE_NAMES)}"
    if key == "llm_int8_skip_modules":
        ok = value is None or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else "expected a list of module names"
    if key in ("load_in_4bit", "load_in_8bit"):
        on = four_bit if key == "load_in_4bit" else not four_bit
        return None if value in (None, on) else f"contradicts the top-level {key}"
    return f"not a setting shardforge reads; it reads {', '.join(BNB_KEYS)}"
