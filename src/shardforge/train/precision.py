"""The precision of the model's weights and layers, set before FSDP2 shards it.

weight_dtype(cfg)              bfloat16 / float16 (or model_kwargs' dtype): the weights'
                               own dtype; None: float32 (the default)
cast_weights(model, cfg)       the meta model's parameters in that dtype (norms of
                               fp32_norms stay float32)
shard_norms_fp32(model, ..)    fp32_norms: each norm module its own FSDP2 unit with a
                               float32 policy (its output cast back to the compute dtype)
apply_fp8(model, cfg)          fp8: torchao's convert_to_float8_training (CUDA, sm >= 8.9)
apply_qat(model, cfg)          qat: torchao's fake-quantized linear (and embedding) layers
QatDelay                       qat.fake_quant_after_n_steps: fake quantization off, then on
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.io.dtypes import torch_dtype

log = logging.getLogger("shardforge")

NORM_SUFFIXES = ("RMSNorm", "LayerNorm")


def weight_dtype(cfg: ShardforgeConfig) -> torch.dtype | None:
    """The dtype the weights are kept in: bfloat16 / float16, else model_kwargs' dtype
    (torch_dtype); None: float32."""
    if cfg.bfloat16:
        return torch.bfloat16
    if cfg.float16:
        return torch.float16
    kwargs = cfg.model_kwargs or {}
    name = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if name is None or name == "auto":
        return None
    name = str(name).removeprefix("torch.")
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError("model_kwargs.dtype", [f"{name!r}: use bfloat16, float16 or float32"])
    return None if name == "float32" else torch_dtype(name)


def is_fp32_norm(module: nn.Module, cfg: ShardforgeConfig) -> bool:
    """`module` is a norm layer fp32_norms keeps in float32 (fp32_norm_classes: a class name
    suffix, or module.Class)."""
    if not cfg.fp32_norms:
        return False
    cls = type(module)
    for pattern in cfg.fp32_norm_classes or NORM_SUFFIXES:
        if not pattern.strip():
            continue
        if "." in pattern and f"{cls.__module__}.{cls.__name__}" == pattern:
            return True
        if "." not in pattern and cls.__name__.endswith(pattern):
            return True
    return False


def cast_weights(model: nn.Module, cfg: ShardforgeConfig, announce: bool = True) -> None:
    """The parameters of `model` (on the meta device) in weight_dtype(cfg); fp32_norms' norm
    layers keep float32."""
    dtype = weight_dtype(cfg)
    if dtype is None:
        return
    kept = {id(p) for m in model.modules() if is_fp32_norm(m, cfg) for p in m.parameters()}
    for param in model.parameters():
        if id(param) not in kept:
            param.data = param.data.to(dtype)
    if announce:
        log.info("weights kept in %s (no float32 copy)", str(dtype).removeprefix("torch."))


def shard_norms_fp32(model: nn.Module, kwargs: dict[str, Any], cfg: ShardforgeConfig) -> int:
    """fp32_norms: fully_shard each norm module with a float32 mixed-precision policy whose
    output is cast to the run's compute dtype (before its block is sharded). Returns how many."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not cfg.fp32_norms:
        return 0
    norms = [m for m in model.modules() if is_fp32_norm(m, cfg)]
    if not norms:
        raise ConfigError(
            "fp32_norm_classes", ["no module of the model matches; name its norm class"]
        )
    outer = kwargs["mp_policy"].param_dtype
    policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=outer
    )
    for norm in norms:
        for param in norm.parameters(recurse=False):
            param.data = param.data.to(torch.float32)
        fully_shard(norm, **{**kwargs, "mp_policy": policy})
    return len(norms)


def _fp8_filter(module: nn.Module, name: str) -> bool:
    """Linear layers float8 can take: not the output layer; both sizes multiples of 16."""
    if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def fp8_refusal() -> str | None:
    """Why fp8 cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "float8 training needs a CUDA GPU (compute capability 8.9+: H100, L4, ...)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"float8 training needs compute capability 8.9+; this GPU has {major}.{minor}"
    return None


def apply_fp8(model: nn.Module, cfg: ShardforgeConfig, announce: bool = True) -> int:
    """fp8: swap the eligible linear layers for torchao's Float8Linear (before sharding).
    Returns how many were converted."""
    if not cfg.fp8:
        return 0
    why = fp8_refusal()
    if why is not None:
        raise ConfigError("fp8", [f"{why}; remove fp8 (bf16 trains the same model)"])
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.fp8_enable_fsdp_float8_all_gather)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=_fp8_filter, config=config)
    after = sum(type(m) is nn.Linear for m in model.modules())
    if announce:
        log.info("fp8: %d linear layer(s) train in float8", before - after)
    return before - after


def _qat_configs(cfg: ShardforgeConfig, embedding: bool = False) -> Any:
    """torchao's QATConfig for cfg.qat, built as Axolotl builds it (weight and activation
    fake-quantize configs); `embedding`: weights only."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    from torchao.quantization.qat.fake_quantize_config import (
        Float8FakeQuantizeConfig,
        Int4WeightFakeQuantizeConfig,
    )

    qat = cfg.qat
    assert qat is not None
    activation = None if embedding else qat.activation_dtype
    if qat.weight_dtype == "int4":
        kwargs: dict[str, Any] = {"group_size": qat.group_size or 128}
        if activation is not None:  # Axolotl's int8 activations: the bf16 int4 path
            kwargs["activation_dtype"] = (
                torch.bfloat16 if activation == "int8" else torch.float8_e4m3fn
            )
        weight: Any = Int4WeightFakeQuantizeConfig(**kwargs)
    else:
        weight = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    acts: Any = None
    if activation == "int8":
        acts = IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)
    elif activation == "float8_e4m3fn":
        acts = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    return QATConfig(weight_config=weight, activation_config=acts)


def apply_qat(model: nn.Module, cfg: ShardforgeConfig, announce: bool = True) -> None:
    """qat: torchao's quantize_ swaps the linear layers (and with quantize_embedding the input
    embedding) for fake-quantized ones, before sharding; their parameters keep their names."""
    if cfg.qat is None:
        return
    from torchao.quantization import quantize_

    shared = _shared_parameters(model)
    quantize_(model, _qat_configs(cfg))
    if cfg.qat.quantize_embedding:
        quantize_(
            model,
            _qat_configs(cfg, embedding=True),
            filter_fn=lambda m, _: isinstance(m, nn.Embedding),
        )
    _share_again(model, shared)
    if announce:
        faked = len(fake_quantizers(model))
        log.info("qat: %d fake quantizer(s) (%s weights)", faked, cfg.qat.weight_dtype)


def _shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several modules hold (tied weights: the input
    embedding and the output layer of tie_word_embeddings), the first one registered first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _share_again(model: nn.Module, shared: list[list[str]]) -> None:
    """Each group of `_shared_parameters` one parameter again, the first name's: a module
    swapped on the meta device holds a new parameter of its own (torchao's from_linear copies
    its weight only off the meta device), which would train the tied weights apart; tied
    again as accelerate's FSDP2 preparation ties Axolotl's (`tie_weights`)."""
    for first, *others in shared:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def fake_quantizers(model: nn.Module) -> list[Any]:
    """The fake quantizers torchao's QAT put into `model` (weights and activations)."""
    out = []
    for module in model.modules():
        for attr in ("weight_fake_quantizer", "activation_fake_quantizer"):
            quantizer = getattr(module, attr, None)
            if quantizer is not None:
                out.append(quantizer)
    return out


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    for quantizer in fake_quantizers(model):
        quantizer.enabled = enabled


def fake_quant_on(cfg: ShardforgeConfig, step: int) -> bool:
    """Fake quantization applies to the step after `step` optimizer steps."""
    after = cfg.qat.fake_quant_after_n_steps if cfg.qat is not None else None
    return after is None or step >= after


# from_pretrained keywords that only say where and how the files are read: FSDP2 places the
# weights, so they change nothing here
_LOADER_ONLY = frozenset(
    {"device_map", "low_cpu_mem_usage", "max_memory", "offload_folder", "use_safetensors"}
)


def apply_model_kwargs(config: Any, cfg: ShardforgeConfig) -> None:
    """model_kwargs (overrides_of_model_kwargs): an attribute of the model's config is set on
    it, as from_pretrained sets such keywords; dtype is weight_dtype's; loader-only keywords
    change nothing; any other keyword is refused."""
    for name, value in (cfg.model_kwargs or {}).items():
        if name in ("dtype", "torch_dtype") or name in _LOADER_ONLY:
            continue
        if name == "attn_implementation":
            raise ConfigError("model_kwargs.attn_implementation", ["set attn_implementation"])
        if not hasattr(config, name):
            raise ConfigError(
                f"model_kwargs.{name}",
                [f"not an attribute of the model's config ({type(config).__name__}); remove it"],
            )
        setattr(config, name, value)
