"""The model for training: built without weights, sharded with FSDP2, then given its base weights.

build_meta_model(cfg)        parameters on the meta device, buffers real (rotary inv_freq ...)
wrap_classes(model, names)   the transformer block classes to shard one by one
shard_model(model, cfg, ...) fully_shard per block and the root; mixed precision, offload;
                             activation checkpointing and torch_compile per block
load_base_weights(model, ..) rank 0 reads the safetensors (converted as from_pretrained
                             converts them), FSDP scatters the slices
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.io.dtypes import torch_dtype
from shardforge.io.files import read_json
from shardforge.train.compile import compile_blocks
from shardforge.train.precision import apply_model_kwargs, shard_norms_fp32

log = logging.getLogger("shardforge")

WEIGHT_INDEX_FILES = ("model.safetensors.index.json",)
WEIGHT_FILES = ("model.safetensors",)


def model_config_source(cfg: ShardforgeConfig) -> str:
    return cfg.base_model_config or cfg.base_model


def tokenizer_source(cfg: ShardforgeConfig) -> str:
    return cfg.tokenizer_config or cfg.base_model


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$|^[A-Za-z0-9][\w.-]*$")


def require_local_or_hub_id(key: str, source: str) -> None:
    """A path that is not a directory must at least look like a hub id (`org/name`)."""
    if not Path(source).is_dir() and (Path(source).exists() or not HUB_ID.match(source)):
        raise ConfigError(key, [f"directory {source} not found; check the path"])


def load_model_config(cfg: ShardforgeConfig) -> Any:
    """The base model's transformers config; a missing or unreadable one names the config key."""
    from transformers import AutoConfig

    key = "base_model_config" if cfg.base_model_config else "base_model"
    source = model_config_source(cfg)
    require_local_or_hub_id(key, source)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            key, [f"cannot read a model config from {source!r} ({first}); check the path"]
        ) from None
    for name, value in (cfg.model_config_overrides or {}).items():
        setattr(config, name, _overridden(getattr(config, name, None), value))
    apply_model_kwargs(config, cfg)  # model_kwargs: config attributes, as from_pretrained
    return config


def _overridden(current: Any, value: Any) -> Any:
    """model_config's value for one config attribute, as Axolotl sets it; a mapping updates a
    mapping (transformers 5 keeps rope_theta in the rope_parameters that rope_scaling names)."""
    if isinstance(current, dict) and isinstance(value, dict):
        return {**current, **value}
    return value


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every nn.Parameter on the meta device; buffers stay real (they are computed)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to(torch.device("meta")), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def runnable_attention(impl: str | None, model_config: Any) -> tuple[str | None, str | None]:
    """`impl`, or the implementation that runs in its place, and the notice saying so: one the
    model class lacks (gpt-oss has no sdpa), or a GPU kernel without a GPU or its package
    (flash_attention_2 without flash-attn, flex_attention without CUDA: torch has no CPU
    backward for it, a hub kernel `org/name` without the kernels package), is replaced by sdpa
    where the model has it, else eager: the same attention, computed another way."""
    from transformers import AutoModelForCausalLM

    if impl is None or impl == "eager":
        return impl, None
    try:
        cls: Any = AutoModelForCausalLM._model_mapping[type(model_config)]
    except KeyError:  # remote code: transformers decides
        return impl, None
    why = _attention_missing(impl, cls)
    if why is None:
        return impl, None
    instead = "sdpa" if impl != "sdpa" and getattr(cls, "_supports_sdpa", False) else "eager"
    return instead, f"attn_implementation: {impl} {why}; {instead} runs instead (same attention)"


def _attention_missing(impl: str, cls: Any) -> str | None:
    """Why `impl` cannot run for model class `cls` here (None: it can)."""
    import importlib.util

    from transformers.utils import is_flash_attn_2_available

    cuda = torch.cuda.is_available()
    flags = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
    if impl.startswith("flash_attention"):
        if not getattr(cls, "_supports_flash_attn", False):
            return f"is not supported by {cls.__name__}"
        if not (cuda and is_flash_attn_2_available()):
            return "needs a CUDA GPU and the flash-attn package"
    elif impl in flags and not getattr(cls, flags[impl], False):
        return f"is not supported by {cls.__name__}"
    elif impl == "flex_attention" and not cuda:
        return "cannot train without a CUDA GPU (torch has no CPU backward for it)"
    elif "/" in impl and not (cuda and importlib.util.find_spec("kernels")):
        return "(a hub kernel) needs a CUDA GPU and the kernels package"
    return None


def build_meta_model(
    cfg: ShardforgeConfig, model_config: Any | None = None, announce: bool = False
) -> nn.Module:
    """The causal LM of `base_model` with all parameters on the meta device (no memory), in
    float32, built from a copy of `model_config`: transformers sets the dtype it builds in on
    the config it is given, and the caller's keeps the base model's (the run's config.json).
    An attention implementation that cannot run here is replaced (`runnable_attention`; its
    notice logged where `announce`)."""
    from transformers import AutoModelForCausalLM

    model_config = copy.deepcopy(model_config) if model_config is not None else None
    model_config = model_config if model_config is not None else load_model_config(cfg)
    extra: dict[str, Any] = {}
    impl, notice = runnable_attention(cfg.attn_implementation, model_config)
    if impl is not None:
        extra["attn_implementation"] = impl
    if notice and announce:
        log.warning("notice: %s", notice)
    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(
                model_config, trust_remote_code=cfg.trust_remote_code, dtype=torch.float32, **extra
            )
    except (ValueError, ImportError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if extra and re.search(r"attn|attention", first, re.IGNORECASE):
            raise ConfigError("attn_implementation", [first]) from None
        raise
    return model


def wrap_classes(model: nn.Module, names: list[str] | None) -> set[type[nn.Module]]:
    """Classes to shard block by block: the configured names, else the model's _no_split_modules.

    A configured name the model does not contain is a ConfigError naming
    `fsdp.transformer_layer_cls_to_wrap` and listing the classes that do exist.
    """
    present = {type(m).__name__: type(m) for m in model.modules()}
    key = "fsdp.transformer_layer_cls_to_wrap"
    if names is None:
        names = list(getattr(model, "_no_split_modules", None) or [])
        key = "_no_split_modules of the model (set fsdp.transformer_layer_cls_to_wrap)"
        names = [n for n in names if n in present]
        if not names:
            raise ConfigError(
                "fsdp.transformer_layer_cls_to_wrap",
                ["cannot auto-detect the transformer block class; set it explicitly"],
            )
    missing = [n for n in names if n not in present]
    if missing:
        blocks = sorted(n for n in present if n.endswith(("Layer", "Block")))
        raise ConfigError(
            key,
            [
                f"class(es) {', '.join(missing)} not in the model "
                f"({type(model).__name__}); blocks it has: {', '.join(blocks) or 'none'}"
            ],
        )
    return {present[n] for n in names}


def use_bf16(cfg: ShardforgeConfig) -> bool:
    """`bf16: auto` means bf16 where the GPU supports it (never on CPU)."""
    if cfg.bf16 == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(cfg.bf16)


def compute_dtypes(cfg: ShardforgeConfig) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) of the FSDP2 mixed-precision policy."""
    mp = cfg.fsdp.mixed_precision
    default = "bfloat16" if use_bf16(cfg) else "float16" if cfg.fp16 else None
    param = mp.param_dtype or default
    reduce = mp.reduce_dtype or ("float32" if param in ("bfloat16", "float16") else None)
    return (torch_dtype(param) if param else None, torch_dtype(reduce) if reduce else None)


def shard_model(
    model: nn.Module, cfg: ShardforgeConfig, mesh: Any, ignored: set[nn.Parameter] | None = None
) -> nn.Module:
    """Apply fully_shard to every transformer block, then to the root module (`ignored`:
    parameters FSDP2 leaves alone, see `quant.unsharded`)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    classes = wrap_classes(model, cfg.fsdp.transformer_layer_cls_to_wrap)
    param_dtype, reduce_dtype = compute_dtypes(cfg)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.fsdp.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # without a GPU the parameters are on the CPU already (preflight's notice)
        "offload_policy": (
            CPUOffloadPolicy()
            if cfg.fsdp.offload_params and torch.cuda.is_available()
            else OffloadPolicy()
        ),
    }
    if ignored:
        kwargs["ignored_params"] = ignored
    if cfg.fsdp.activation_checkpointing or cfg.gradient_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ConfigError("fsdp.activation_checkpointing", ["the model does not support it"])
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = [m for m in model.modules() if type(m) in classes]
    compile_blocks(blocks, cfg)  # torch_compile: in place, inside checkpointing, under FSDP
    shard_norms_fp32(model, kwargs, cfg)  # fp32_norms: a float32 unit per norm, first
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    log.info("sharded %d transformer blocks plus the root", len(blocks))
    return model


def _weight_files(base: Path) -> list[Path]:
    for name in WEIGHT_INDEX_FILES:
        index = base / name
        if index.is_file():
            weight_map = read_json(index, base)["weight_map"]  # its size capped
            return [base / f for f in sorted(set(weight_map.values()))]
    files = [base / n for n in WEIGHT_FILES if (base / n).is_file()]
    if not files:
        raise ConfigError(
            "base_model", [f"no model.safetensors (or index) in {base}; train needs local weights"]
        )
    return files


def read_full_state_dict(base_model: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The base weights as float32 tensors keyed like `model`'s state dict (rank 0 only)."""
    from safetensors.torch import load_file

    from shardforge.keymap.conversion import loaded_state_dict
    from shardforge.keymap.keys import tied_pairs
    from shardforge.train.vocab import extend_rows

    base = Path(base_model)
    if not base.is_dir():
        from huggingface_hub import snapshot_download

        base = Path(snapshot_download(base_model, allow_patterns=["*.safetensors", "*.json"]))
    expected = dict.fromkeys(model.state_dict(), True)
    stored: dict[str, torch.Tensor] = {}
    for file in _weight_files(base):
        stored.update(load_file(str(file)))
    # as from_pretrained loads them: transformers' conversions (per-expert MoE weights fused)
    out = {k: v.to(torch.float32) for k, v in loaded_state_dict(model, stored, expected).items()}
    del stored
    extend_rows(out, model)  # rows for tokens the config added (vocab.grow_vocab_size)
    for target, source in tied_pairs(model, model.config).items():
        if target not in out and source in out:  # stored once by save_pretrained
            out[target] = out[source]
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ConfigError("base_model", [f"weights missing from {base}: {', '.join(missing[:5])}"])
    return out


def materialize_and_load(
    model: nn.Module,
    cfg: ShardforgeConfig,
    device: torch.device,
    rank: int,
    weights: dict[str, torch.Tensor] | None = None,
    quantized: set[str] | None = None,
) -> None:
    """Allocate the local shards on `device` and fill them with the base weights.

    Only rank 0 reads the files (or is handed `weights`, e.g. with a LoRA adapter's names);
    `set_model_state_dict(broadcast_from_rank0=True)` sends each rank its slices. Non-persistent buffers (rotary inv_freq ...) were computed at build time and
    are restored after `to_empty`, which would otherwise leave them uninitialised.
    The `quantized` parameters (QLoRA, 8-bit LoRA) are filled by `quant.load_quantized`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.fsdp.offload_params else device)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
    full: dict[str, Any] = {}
    if rank == 0:
        full = weights if weights is not None else read_full_state_dict(cfg.base_model, model)
    quantized_full = {k: full.pop(k) for k in quantized or () if k in full}
    set_model_state_dict(
        model,
        full,
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=not quantized
        ),
    )
    if quantized:
        from shardforge.train.quant import load_quantized

        load_quantized(model, quantized_full, quantized, device)
